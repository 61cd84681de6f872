// Generation on an inference server: one Generate stream carries many requests, never more at once
// than the server's latest `Capacity.max_in_flight`.
import { randomUUID } from "node:crypto";
import type { MessageInitShape } from "@bufbuild/protobuf";
import { createClient, type Client, type Transport } from "@connectrpc/connect";
import { Code, PipelineError, fromCallError, fromStatus, unary } from "./errors.js";
import type { TokenSequence } from "./gen/pipelinerl/common/v1/common_pb.js";
import {
  InferenceService,
  type Capacity,
  type Completion,
  type GenerateRequestSchema,
  type GenerateResponse,
  type GetStatusResponse,
  type SubmissionSchema,
} from "./gen/pipelinerl/inference/v1/inference_pb.js";
import { Queue } from "./queue.js";
import { streamOptions } from "./transport.js";

/** A submission; an empty `requestId` gets a random one, `streamTokens` follows `onDelta`. */
export type SubmissionInit = Omit<MessageInitShape<typeof SubmissionSchema>, "streamTokens" | "$typeName">;

export interface GenerateOptions {
  /** Receives the tokens of each `TokenDelta` as they are generated: every token once, in order. */
  readonly onDelta?: (tokens: TokenSequence) => void;
  /** Aborting cancels the request on the server; the promise rejects with the signal's reason. */
  readonly signal?: AbortSignal;
}

function deferred(): { promise: Promise<void>; resolve: () => void } {
  let resolve!: () => void;
  const promise = new Promise<void>((done) => (resolve = done));
  return { promise, resolve };
}

interface Pending {
  resolve(completion: Completion): void;
  reject(error: unknown): void;
  onDelta?: (tokens: TokenSequence) => void;
}

/**
 * One Generate stream. `generate()` waits for a free slot in the server's window before it submits.
 * However the stream ends (the server drains or goes away, `close()`), every request still on it
 * rejects with UNAVAILABLE: the server went away, not the request.
 */
export class GenerateSession {
  private readonly requests = new Queue<MessageInitShape<typeof GenerateRequestSchema>>();
  private readonly pending = new Map<string, Pending>();
  private readonly call = new AbortController();
  private latest: Capacity | undefined;
  private ended: string | undefined;
  private failure: PipelineError | undefined;
  private changed = deferred();
  /** Why the stream ended, once it has. */
  readonly closed: Promise<string>;

  private constructor(client: Client<typeof InferenceService>) {
    this.closed = this.read(client.generate(this.requests, streamOptions(this.call.signal)));
  }

  /** A new stream, once the server has sent its first Capacity. */
  static async open(client: Client<typeof InferenceService>): Promise<GenerateSession> {
    const session = new GenerateSession(client);
    while (session.latest === undefined && session.ended === undefined) {
      await session.changed.promise;
    }
    if (session.ended !== undefined) {
      throw session.failure ?? session.gone(); // refused (UNAUTHENTICATED, ...) or gone at once
    }
    return session;
  }

  /** The server's latest Capacity: its window, limits and model (vocabulary, special tokens). */
  get capacity(): Capacity {
    return this.latest!;
  }

  /** Requests the server accepts in flight on this stream now; 0 once the stream is ending. */
  get window(): number {
    return this.ended !== undefined || this.requests.isEnded ? 0 : this.capacity.maxInFlight;
  }

  /** Requests submitted that have not finished yet. */
  get inFlight(): number {
    return this.pending.size;
  }

  /** Submits once a slot is free; the completion, or the request's error as a PipelineError. */
  async generate(submission: SubmissionInit, options: GenerateOptions = {}): Promise<Completion> {
    const { onDelta, signal } = options;
    const wake = () => this.notify();
    signal?.addEventListener("abort", wake);
    try {
      // No await between this check and taking the slot below, so concurrent calls cannot all see
      // the same free slot.
      while (!signal?.aborted && this.pending.size >= this.window && this.window > 0) {
        await this.changed.promise;
      }
    } finally {
      signal?.removeEventListener("abort", wake);
    }
    signal?.throwIfAborted();
    if (this.window === 0) {
      throw this.gone();
    }
    const requestId = submission.requestId || randomUUID();
    if (this.pending.has(requestId)) {
      const why = "is the id of a request in flight on this stream";
      throw new PipelineError(Code.InvalidArgument, `submit.request_id: ${why}`, [
        { field: "submit.request_id", description: why },
      ]);
    }
    const completion = new Promise<Completion>((resolve, reject) => {
      this.pending.set(requestId, { resolve, reject, onDelta });
    });
    this.requests.push({
      action: { case: "submit", value: { ...submission, requestId, streamTokens: onDelta !== undefined } },
    });
    const cancel = () => this.cancel(requestId, signal!.reason);
    signal?.addEventListener("abort", cancel, { once: true });
    try {
      return await completion;
    } finally {
      signal?.removeEventListener("abort", cancel);
    }
  }

  /** Half-closes the stream: no new request; the server finishes those in flight, then ends it. */
  closeWhenIdle(): Promise<string> {
    this.requests.end();
    this.notify();
    return this.closed;
  }

  /** Cancels the call: the server aborts every request still running on it. */
  close(): Promise<string> {
    this.call.abort();
    return this.closed;
  }

  private cancel(requestId: string, reason: unknown): void {
    const pending = this.pending.get(requestId);
    if (pending === undefined) {
      return;
    }
    // It holds its slot until the server answers (a Completion with finish reason ABORT).
    pending.onDelta = undefined;
    pending.reject(reason);
    if (!this.requests.isEnded) {
      this.requests.push({ action: { case: "cancel", value: { requestId } } });
    }
  }

  private async read(responses: AsyncIterable<GenerateResponse>): Promise<string> {
    let why = "the inference server ended the stream";
    try {
      for await (const response of responses) {
        this.dispatch(response);
      }
    } catch (error) {
      this.failure = fromCallError(error);
      why = `the Generate stream failed: ${Code[this.failure.code]}: ${this.failure.message}`;
    }
    this.ended = why;
    for (const pending of this.pending.values()) {
      pending.reject(this.gone());
    }
    this.pending.clear();
    this.notify();
    return why;
  }

  private dispatch({ event }: GenerateResponse): void {
    if (event.case === "capacity") {
      this.latest = event.value;
      this.notify();
    } else if (event.case === "delta") {
      this.pending.get(event.value.requestId)?.onDelta?.(event.value.tokens!);
    } else if (event.case === "completion") {
      this.finish(event.value.requestId)?.resolve(event.value);
    } else if (event.case === "error") {
      this.finish(event.value.requestId)?.reject(fromStatus(event.value.status));
    }
  }

  private finish(requestId: string): Pending | undefined {
    const pending = this.pending.get(requestId);
    this.pending.delete(requestId);
    this.notify();
    return pending;
  }

  private notify(): void {
    this.changed.resolve();
    this.changed = deferred();
  }

  private gone(): PipelineError {
    return new PipelineError(Code.Unavailable, this.ended ?? "the stream takes no new request");
  }
}

export class InferenceClient {
  /** The generated client, for what this class does not wrap. */
  readonly raw: Client<typeof InferenceService>;

  constructor(transport: Transport) {
    this.raw = createClient(InferenceService, transport);
  }

  /** A new Generate stream; end it with `closeWhenIdle()` or `close()`. */
  session(): Promise<GenerateSession> {
    return GenerateSession.open(this.raw);
  }

  /** The weight version served, load, and the model. */
  status(): Promise<GetStatusResponse> {
    return unary(() => this.raw.getStatus({}));
  }
}
