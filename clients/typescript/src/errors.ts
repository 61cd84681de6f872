// Failed calls as one typed error: the gRPC status code and the google.rpc.BadRequest field
// violations, whether they came in the `grpc-status-details-bin` trailer of a call or in the
// `RequestError.status` of one request on a Generate stream.
import { anyUnpack } from "@bufbuild/protobuf/wkt";
import { Code, ConnectError } from "@connectrpc/connect";
import { BadRequestSchema, type BadRequest } from "./gen/google/rpc/error_details_pb.js";
import type { Status } from "./gen/google/rpc/status_pb.js";

export { Code };

/** One bad field: `field` is its path from the request message's root, such as `submit.prompt_token_ids[3]`. */
export interface FieldViolation {
  readonly field: string;
  readonly description: string;
}

export class PipelineError extends Error {
  override readonly name = "PipelineError";

  constructor(
    /** The gRPC status code (INVALID_ARGUMENT is `Code.InvalidArgument`, 3). */
    readonly code: Code,
    message: string,
    /** The field violations of an INVALID_ARGUMENT; empty for other codes. */
    readonly violations: readonly FieldViolation[] = [],
    options?: ErrorOptions,
  ) {
    super(message, options);
  }
}

function violationsOf(requests: BadRequest[]): FieldViolation[] {
  return requests.flatMap((request) =>
    request.fieldViolations.map(({ field, description }) => ({ field, description })),
  );
}

/** Any error a call threw, as a PipelineError (the status details decoded). */
export function fromCallError(error: unknown): PipelineError {
  if (error instanceof PipelineError) {
    return error;
  }
  const connect = ConnectError.from(error);
  const violations = violationsOf(connect.findDetails(BadRequestSchema));
  return new PipelineError(connect.code, connect.rawMessage, violations, { cause: error });
}

/** A `google.rpc.Status` message (the `status` of a Generate `RequestError`) as a PipelineError. */
export function fromStatus(status: Status | undefined): PipelineError {
  const requests = (status?.details ?? []).flatMap((detail) => anyUnpack(detail, BadRequestSchema) ?? []);
  const code = (status?.code || Code.Unknown) as Code;
  return new PipelineError(code, status?.message ?? "", violationsOf(requests));
}

/** The result of `call`, or its error as a PipelineError. */
export async function unary<T>(call: () => Promise<T>): Promise<T> {
  try {
    return await call();
  } catch (error) {
    throw fromCallError(error);
  }
}

/** The messages of a server stream; its error as a PipelineError. */
export async function* streamed<T>(stream: AsyncIterable<T>): AsyncGenerator<T> {
  try {
    yield* stream;
  } catch (error) {
    throw fromCallError(error);
  }
}
