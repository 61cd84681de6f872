// Runs on a coordinator: start one and follow it to its end.
import type { MessageInitShape } from "@bufbuild/protobuf";
import { createClient, type Client, type Transport } from "@connectrpc/connect";
import { streamed, unary } from "./errors.js";
import {
  CoordinatorService,
  RunState,
  type EvaluationResult,
  type EvaluationSpecSchema,
  type Run,
  type RunSpecSchema,
} from "./gen/pipelinerl/coordinator/v1/coordinator_pb.js";
import { streamOptions } from "./transport.js";

export type RunSpecInit = MessageInitShape<typeof RunSpecSchema>;
export type EvaluationSpecInit = MessageInitShape<typeof EvaluationSpecSchema>;

const ENDED = new Set([RunState.COMPLETED, RunState.STOPPED, RunState.FAILED]);

/** Whether the run has ended: completed, stopped or failed. */
export function hasEnded(run: Run): boolean {
  return ENDED.has(run.state);
}

/** Every method throws a PipelineError (INVALID_ARGUMENT names the wrong field of the spec). */
export class CoordinatorClient {
  /** The generated client, for what this class does not wrap. */
  readonly raw: Client<typeof CoordinatorService>;

  constructor(transport: Transport) {
    this.raw = createClient(CoordinatorService, transport);
  }

  /** Starts a run (an empty `runId`: the server picks one), or returns the run with that id as it is. */
  async startRun(spec: RunSpecInit, runId = ""): Promise<Run> {
    const response = await unary(() => this.raw.startRun({ runId, spec }));
    return response.run!;
  }

  async getRun(runId: string): Promise<Run> {
    return (await unary(() => this.raw.getRun({ runId }))).run!;
  }

  /** Stops dispatching; a later `startRun` with the same id resumes the run. */
  async stopRun(runId: string): Promise<Run> {
    return (await unary(() => this.raw.stopRun({ runId }))).run!;
  }

  /** The run about once per second, until it ends or `signal` aborts. */
  async *watchRun(runId: string, signal?: AbortSignal): AsyncGenerator<Run> {
    for await (const response of streamed(this.raw.watchRun({ runId }, streamOptions(signal)))) {
      yield response.run!;
    }
  }

  /**
   * Evaluates a held-out set once on the coordinator's inference servers, at the newest version one
   * of them holds (`sampling.maxNewTokens` must be set); nothing is trained. Give a deadline in
   * `timeoutMs` long enough for the whole set.
   */
  async evaluate(evaluation: EvaluationSpecInit, timeoutMs?: number): Promise<EvaluationResult> {
    return (await unary(() => this.raw.evaluate({ evaluation }, { timeoutMs }))).result!;
  }

  /** Starts (or resumes) a run and yields it as it progresses: first as started, last as it ended. */
  async *run(spec: RunSpecInit, options: { runId?: string; signal?: AbortSignal } = {}): AsyncGenerator<Run> {
    const started = await this.startRun(spec, options.runId);
    yield started;
    if (!hasEnded(started)) {
      yield* this.watchRun(started.runId, options.signal);
    }
  }
}
