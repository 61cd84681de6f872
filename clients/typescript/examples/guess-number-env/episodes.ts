// The episode table of an EnvironmentService: the rules the proto (environment.proto) sets for every
// implementation, kept here once so that a game only says what it replies.
//
//   start(id, seed, task) ──► game.start ──► opening (stored; a repeat returns it)
//   step(id, turn, action) ─► instance.step ──► answer (stored as the last turn's; a repeat returns it)
//   end(id) / its lease runs out (reapIdle) / the game's code throws ──► no longer held (NOT_FOUND)
//
// Every call runs to its end without awaiting, so two calls of one episode never interleave: a
// retry always finds the stored answer of the call it repeats.
import { create } from "@bufbuild/protobuf";
import { Code, ConnectError } from "@connectrpc/connect";
import { BadRequestSchema } from "../../src/gen/google/rpc/error_details_pb.js";
import {
  MessageSchema,
  Role,
  StepEpisodeResponseSchema,
  StartEpisodeResponseSchema,
  type Message,
  type StartEpisodeResponse,
  type StepEpisodeResponse,
  type Tool,
} from "../../src/gen/pipelinerl/environment/v1/environment_pb.js";

/** The opening of an episode: system and user messages, and its turn limit (0: none). */
export interface Opening {
  readonly messages: readonly Message[];
  readonly maxTurns: number;
}

/** The game's answer to one turn: user and tool messages, named rewards, whether it ended. */
export interface Step {
  readonly messages: readonly Message[];
  readonly rewards?: Readonly<Record<string, number>>;
  readonly terminated?: boolean;
  readonly truncated?: boolean;
}

/** One episode of a game. */
export interface Instance {
  readonly opening: Opening;
  step(action: Message): Step;
}

/** A game: what DescribeEnvironment says, and how an episode starts. */
export interface Game {
  readonly name: string;
  readonly version: string;
  readonly description: string;
  readonly tools: readonly Tool[];
  /** Most turns of an episode; 0: no limit. */
  readonly maxTurns: number;
  /** Starts an episode; throws `invalidArgument("task", ...)` for a task it does not know. */
  start(seed: bigint, task: string): Instance;
}

/** The server's limits on episodes. */
export interface Limits {
  readonly maxEpisodes: number;
  readonly leaseS: number;
  readonly maxObservationBytes: number;
}

export const ID_PATTERN = /^[A-Za-z0-9._:-]{1,128}$/;
export const MAX_TASK_BYTES = 64 * 1024;
export const MAX_TOOL_CALLS = 256;

/** INVALID_ARGUMENT with a google.rpc.BadRequest naming `field`. */
export function invalidArgument(field: string, description: string): ConnectError {
  return new ConnectError(`${field}: ${description}`, Code.InvalidArgument, undefined, [
    { desc: BadRequestSchema, value: { fieldViolations: [{ field, description }] } },
  ]);
}

function checkEpisodeId(episodeId: string): void {
  if (!ID_PATTERN.test(episodeId)) {
    throw invalidArgument("episode_id", "must be 1 to 128 characters of [A-Za-z0-9._:-]");
  }
}

function checkAction(action: Message | undefined): Message {
  if (action === undefined || action.role !== Role.ASSISTANT) {
    const role = action === undefined ? "UNSPECIFIED" : (Role[action.role] ?? String(action.role));
    throw invalidArgument("action.role", `is ${role}; the model's turn is ASSISTANT`);
  }
  if (action.toolCalls.length > MAX_TOOL_CALLS) {
    throw invalidArgument("action.tool_calls", `has more than ${MAX_TOOL_CALLS} calls`);
  }
  const seen = new Map<string, number>();
  action.toolCalls.forEach((call, index) => {
    const field = `action.tool_calls[${index}].id`;
    if (!ID_PATTERN.test(call.id)) {
      throw invalidArgument(field, "must be 1 to 128 characters of [A-Za-z0-9._:-]");
    }
    const first = seen.get(call.id);
    if (first !== undefined) {
      throw invalidArgument(field, `'${call.id}' repeats action.tool_calls[${first}].id`);
    }
    seen.set(call.id, index);
  });
  return action;
}

function sameMessage(a: Message, b: Message): boolean {
  return (
    a.role === b.role &&
    a.content === b.content &&
    a.toolCallId === b.toolCallId &&
    a.name === b.name &&
    a.toolCalls.length === b.toolCalls.length &&
    a.toolCalls.every((call, i) => {
      const other = b.toolCalls[i];
      return call.id === other.id && call.name === other.name && call.arguments === other.arguments;
    })
  );
}

/** The game answered against the contract: thrown inside a call, it ends the episode (INTERNAL). */
class ContractBroken extends Error {}

function checkMessages(
  messages: readonly Message[],
  allowed: readonly Role[],
  where: string,
  maxBytes: number,
  callIds: ReadonlySet<string> = new Set(),
): Message[] {
  let bytes = 0;
  messages.forEach((message, index) => {
    if (!allowed.includes(message.role)) {
      const role = Role[message.role] ?? String(message.role);
      throw new ContractBroken(`${where}: messages[${index}] is ${role}; an environment does not write it`);
    }
    if (message.toolCalls.length > 0) {
      throw new ContractBroken(`${where}: messages[${index}] has tool calls; only the model makes them`);
    }
    if (message.role === Role.TOOL && !callIds.has(message.toolCallId)) {
      throw new ContractBroken(`${where}: messages[${index}] answers a tool call the model's turn did not make`);
    }
    bytes += Buffer.byteLength(message.content, "utf8");
  });
  if (bytes > maxBytes) {
    throw new ContractBroken(`${where}: ${bytes} bytes of content; the limit is ${maxBytes}`);
  }
  return [...messages];
}

interface Held {
  readonly id: string;
  readonly seed: bigint;
  readonly task: string;
  readonly instance: Instance;
  readonly opening: StartEpisodeResponse;
  lastUsed: number;
  /** The turn answered last; 0 before the first. */
  turn: number;
  action?: Message;
  answer?: StepEpisodeResponse;
}

export interface Counts {
  started: bigint;
  steps: bigint;
  reaped: bigint;
  failures: bigint;
}

export class EpisodeTable {
  private readonly episodes = new Map<string, Held>();
  private draining = false;
  readonly counts: Counts = { started: 0n, steps: 0n, reaped: 0n, failures: 0n };

  constructor(
    readonly game: Game,
    readonly limits: Limits,
    private readonly clock: () => number = () => performance.now() / 1000,
  ) {}

  get active(): number {
    return this.episodes.size;
  }

  start(episodeId: string, seed: bigint, task: string): StartEpisodeResponse {
    checkEpisodeId(episodeId);
    if (Buffer.byteLength(task, "utf8") > MAX_TASK_BYTES) {
      throw invalidArgument("task", `is longer than ${MAX_TASK_BYTES} bytes`);
    }
    const held = this.episodes.get(episodeId);
    if (held !== undefined) {
      if (held.seed !== seed || held.task !== task) {
        throw new ConnectError(
          `episode ${episodeId} was started with seed ${held.seed} and another task or seed; an id names one episode`,
          Code.FailedPrecondition,
        );
      }
      held.lastUsed = this.clock();
      return held.opening;
    }
    if (this.draining) {
      throw new ConnectError("the server is draining; start the episode on another replica", Code.Unavailable);
    }
    if (this.episodes.size >= this.limits.maxEpisodes) {
      throw new ConnectError(
        `the server holds ${this.episodes.size} episodes, its max_episodes; end one or retry later`,
        Code.ResourceExhausted,
      );
    }
    const { instance, opening } = this.guarded(episodeId, "start", () => {
      const instance = this.game.start(seed, task);
      const messages = checkMessages(instance.opening.messages, [Role.SYSTEM, Role.USER], "start",
        this.limits.maxObservationBytes);
      const opening = create(StartEpisodeResponseSchema, {
        messages,
        tools: [...this.game.tools],
        maxTurns: instance.opening.maxTurns,
      });
      return { instance, opening };
    });
    this.episodes.set(episodeId, { id: episodeId, seed, task, instance, opening, lastUsed: this.clock(), turn: 0 });
    this.counts.started += 1n;
    return opening;
  }

  step(episodeId: string, turn: number, requested: Message | undefined): StepEpisodeResponse {
    checkEpisodeId(episodeId);
    if (turn < 1) {
      throw invalidArgument("turn", `is ${turn}; the model's first answer is turn 1`);
    }
    const action = checkAction(requested);
    const held = this.held(episodeId);
    held.lastUsed = this.clock();
    if (turn === held.turn && held.answer !== undefined) {
      if (!sameMessage(held.action!, action)) {
        throw new ConnectError(
          `turn ${turn} of episode ${episodeId} was answered for another action; a retry sends the same`,
          Code.FailedPrecondition,
        );
      }
      return held.answer;
    }
    if (held.answer?.terminated || held.answer?.truncated) {
      const how = held.answer.terminated ? "terminated" : "was truncated";
      throw new ConnectError(
        `episode ${episodeId} ${how} at turn ${held.turn}; it takes no turn ${turn}`,
        Code.FailedPrecondition,
      );
    }
    if (turn !== held.turn + 1) {
      throw new ConnectError(
        `turn ${turn} of episode ${episodeId} is out of order: the last answered is ${held.turn}`,
        Code.FailedPrecondition,
      );
    }
    const answer = this.guarded(episodeId, `step of turn ${turn}`, () => {
      const step = held.instance.step(action);
      const callIds = new Set(action.toolCalls.map((call) => call.id));
      const messages = checkMessages(step.messages, [Role.USER, Role.TOOL], `step of turn ${turn}`,
        this.limits.maxObservationBytes, callIds);
      const rewards = Object.entries(step.rewards ?? {}).map(([name, value]) => {
        if (!name || !Number.isFinite(value)) {
          throw new ContractBroken(`step of turn ${turn}: reward '${name}' is ${value}`);
        }
        return { name, value };
      });
      const terminated = step.terminated ?? false;
      const maxTurns = held.opening.maxTurns;
      const truncated = (step.truncated ?? false) || (maxTurns > 0 && turn >= maxTurns && !terminated);
      return create(StepEpisodeResponseSchema, { messages, rewards, terminated, truncated, turn });
    }, held);
    held.turn = turn;
    held.action = action;
    held.answer = answer;
    this.counts.steps += 1n;
    return answer;
  }

  /** Ends the episode; one not held is already ended. */
  end(episodeId: string): void {
    checkEpisodeId(episodeId);
    this.episodes.delete(episodeId);
  }

  /** Ends every episode idle for its lease; returns their ids. */
  reapIdle(): string[] {
    const deadline = this.clock() - this.limits.leaseS;
    const idle = [...this.episodes.values()].filter((held) => held.lastUsed <= deadline);
    for (const held of idle) {
      this.episodes.delete(held.id);
      this.counts.reaped += 1n;
    }
    return idle.map((held) => held.id);
  }

  /** New episodes are refused (UNAVAILABLE); held ones are still answered. */
  stopStarting(): void {
    this.draining = true;
  }

  private held(episodeId: string): Held {
    const held = this.episodes.get(episodeId);
    if (held === undefined) {
      throw new ConnectError(
        `episode ${episodeId} is not held: never started, ended, failed or reaped`,
        Code.NotFound,
      );
    }
    return held;
  }

  /** `call()`; a failure of the game's code ends the episode (`held`), counted, as INTERNAL. The
   * INVALID_ARGUMENT of a start (a task the game does not know) is the caller's, and passes. */
  private guarded<T>(episodeId: string, what: string, call: () => T, held?: Held): T {
    try {
      return call();
    } catch (error) {
      if (held === undefined && error instanceof ConnectError && error.code === Code.InvalidArgument) {
        throw error;
      }
      this.counts.failures += 1n;
      if (held !== undefined && this.episodes.get(episodeId) === held) {
        this.episodes.delete(episodeId);
      }
      const reason = error instanceof Error ? error.message : String(error);
      console.error(`episode ${episodeId} failed: ${what}: ${reason}`);
      throw new ConnectError(`${what} failed: ${reason}`, Code.Internal);
    }
  }
}

/** A user message. */
export function user(content: string): Message {
  return create(MessageSchema, { role: Role.USER, content });
}
