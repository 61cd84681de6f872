// The client against the four real services (tiny model on CPU), every one behind a bearer token.
import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { after, before, test } from "node:test";
import { fileURLToPath } from "node:url";
import { promisify } from "node:util";
import { createClient } from "@connectrpc/connect";
import { HealthCheckResponse_ServingStatus, Health } from "../src/gen/health/v1/health_pb.js";
import { Mode } from "../src/gen/pipelinerl/coordinator/v1/coordinator_pb.js";
import {
  Code,
  CoordinatorClient,
  GenerateSession,
  InferenceClient,
  PipelineError,
  createTransport,
} from "../src/index.js";
import { startServices, type Services } from "./services.js";

const TOKEN = "ts-client";
const BUDGET = 128;
let services: Services;

before(async () => {
  services = await startServices(TOKEN);
}, { timeout: 240_000 });

after(() => services?.stop());

/** A transport to `service` that sends `token`, none when it is null. */
function transport(service: string, token: string | null = TOKEN) {
  return createTransport({ address: services.addresses[service], token: token ?? undefined });
}

/** An example's JSON result (its last line), run as a user would run it. */
async function example(name: string, service: string, ...args: string[]): Promise<Record<string, unknown>> {
  const script = fileURLToPath(new URL(`../examples/${name}.js`, import.meta.url));
  const address = services.addresses[service];
  const { stdout } = await promisify(execFile)(
    process.execPath,
    [script, "--address", address, "--token", TOKEN, ...args],
    { timeout: 120_000 },
  );
  return JSON.parse(stdout.trim().split("\n").at(-1)!);
}

/** `use` on a new Generate session, closed (whatever is left on it cancelled) when `use` ends. */
async function withSession<T>(use: (session: GenerateSession) => Promise<T>): Promise<T> {
  const session = await new InferenceClient(transport("inference-0")).session();
  try {
    return await use(session);
  } finally {
    await session.close();
  }
}

async function rejection(promise: Promise<unknown>): Promise<PipelineError> {
  const error = await promise.then(
    () => assert.fail("expected the call to fail"),
    (error: unknown) => error,
  );
  assert.ok(error instanceof PipelineError, `not a PipelineError: ${error}`);
  return error;
}

test("a call without the bearer token is refused with UNAUTHENTICATED", async () => {
  const coordinator = new CoordinatorClient(transport("coordinator", null));
  assert.equal((await rejection(coordinator.getRun("any"))).code, Code.Unauthenticated);
  const inference = new InferenceClient(transport("inference-0", "wrong"));
  assert.equal((await rejection(inference.session())).code, Code.Unauthenticated);
});

test("health Check and Watch answer SERVING, without the token", async () => {
  for (const service of ["coordinator", "inference-0", "reward", "trainer"]) {
    const health = createClient(Health, transport(service, null));
    assert.equal((await health.check({})).status, HealthCheckResponse_ServingStatus.SERVING, service);
    const watching = new AbortController();
    for await (const update of health.watch({}, { signal: watching.signal, timeoutMs: 0 })) {
      assert.equal(update.status, HealthCheckResponse_ServingStatus.SERVING, service);
      break; // leaving the loop cancels the call
    }
  }
});

test("Generate streams every token once, then the completion with its logprobs and versions", () =>
  withSession(async (session) => {
    const info = session.capacity.modelInfo!;
    assert.ok(info.vocabSize > 0 && info.eosTokenIds.length > 0 && info.model !== "");
    const streamed: number[] = [];
    const completion = await session.generate(
      { promptTokenIds: [5, 6, 7], sampling: { maxNewTokens: 6, seed: 3n } },
      { onDelta: (tokens) => streamed.push(...tokens.tokenIds) },
    );
    const tokens = completion.completion!;
    assert.ok(tokens.tokenIds.length >= 1);
    assert.deepEqual(streamed, tokens.tokenIds);
    assert.equal(tokens.logprobs.length, tokens.tokenIds.length);
    assert.ok(tokens.logprobs.every((logprob) => logprob <= 0));
    assert.equal(tokens.versions.length, tokens.tokenIds.length);
  }));

test("a session keeps no more requests in flight than the server's Capacity allows", () =>
  withSession(async (session) => {
    // More requests at once than the window: the server would refuse those over it
    // (RESOURCE_EXHAUSTED); the session holds them back until a slot is free.
    const count = session.capacity.maxInFlight + 8;
    const requests = Array.from({ length: count }, (_, i) =>
      session.generate({ promptTokenIds: [3, 4 + (i % 50)], sampling: { maxNewTokens: 2 } }),
    );
    assert.equal((await Promise.all(requests)).length, count);
  }));

test("a refused request rejects with a PipelineError naming its field; the stream goes on", () =>
  withSession(async (session) => {
    const { modelInfo, maxNewTokens } = session.capacity;
    const outOfRange = await rejection(
      session.generate({ promptTokenIds: [1, modelInfo!.vocabSize], sampling: { maxNewTokens: 1 } }),
    );
    assert.equal(outOfRange.code, Code.InvalidArgument);
    assert.deepEqual(outOfRange.violations.map((v) => v.field), ["submit.prompt_token_ids[1]"]);
    const tooLong = await rejection(
      session.generate({ promptTokenIds: [1], sampling: { maxNewTokens: maxNewTokens + 1 } }),
    );
    assert.deepEqual(tooLong.violations.map((v) => v.field), ["submit.sampling.max_new_tokens"]);
    const completion = await session.generate({ promptTokenIds: [1], sampling: { maxNewTokens: 1 } });
    assert.equal(completion.completion!.tokenIds.length, 1);
  }));

test("an aborted request rejects at once and is cancelled on the server", () =>
  withSession(async (session) => {
    const { maxNewTokens, maxContext } = session.capacity;
    const aborting = new AbortController();
    const running = session.generate(
      { promptTokenIds: [1, 2], sampling: { maxNewTokens: Math.min(maxNewTokens, maxContext - 2) } },
      { signal: aborting.signal, onDelta: () => aborting.abort(new Error("enough")) },
    );
    await assert.rejects(running, /enough/);
    const why = await session.closeWhenIdle(); // ends once the server has answered the cancellation
    assert.equal(why, "the inference server ended the stream");
    assert.equal(session.inFlight, 0);
  }));

test("a bad run spec is INVALID_ARGUMENT with its field, from the status trailer", async () => {
  const coordinator = new CoordinatorClient(transport("coordinator"));
  const spec = { dataset: "builtin:copy:2", groupSize: 1, maxInFlight: 8, mode: Mode.PIPELINE };
  const error = await rejection(coordinator.startRun(spec));
  assert.equal(error.code, Code.InvalidArgument);
  assert.deepEqual(error.violations.map((v) => v.field), ["spec.group_size"]);
  assert.equal((await rejection(coordinator.getRun("no-such-run"))).code, Code.NotFound);
});

test("examples/generate.ts streams a completion with logprobs and versions", async () => {
  const result = await example("generate", "inference-0", "--max-new-tokens", "5");
  const tokenIds = result.tokenIds as number[];
  assert.ok(tokenIds.length >= 1);
  assert.deepEqual(result.streamedTokenIds, tokenIds);
  assert.equal((result.logprobs as number[]).length, tokenIds.length);
  assert.equal((result.versions as number[]).length, tokenIds.length);
});

test("examples/start-run.ts runs the built-in task to its budget", async () => {
  const result = await example("start-run", "coordinator", "--max-samples", String(BUDGET));
  assert.equal(result.state, "COMPLETED");
  assert.ok((result.trained as number) + (result.dropped as number) >= BUDGET);
  assert.ok((result.trainerVersion as number) >= 1);
});

test("evaluate: a held-out set's figures, every completion at one weight version", async () => {
  const coordinator = new CoordinatorClient(transport("coordinator"));
  const sampling = { maxNewTokens: 3, temperature: 0 };
  const result = await coordinator.evaluate({ dataset: "builtin:copy:2", samplesPerProblem: 2, sampling }, 120_000);
  assert.equal(result.dataset, "builtin:copy:2");
  assert.equal(result.problems, 11); // the held-out prompts of copy:2
  assert.equal(result.samplesPerProblem, 2);
  assert.ok(result.weightVersion >= 0n);
  assert.ok(result.passAt1 >= 0 && result.passAt1 <= result.passAtK && result.passAtK <= 1);
  const error = await rejection(coordinator.evaluate({ dataset: "builtin:copy:2", samplesPerProblem: 1 }));
  assert.equal(error.code, Code.InvalidArgument); // max_new_tokens must be set outside a run
});
