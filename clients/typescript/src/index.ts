// The hand-written layer; the generated messages and services are under `./gen/` (package export
// `@pipelinerl/client/gen/...`), for example `gen/pipelinerl/trainer/v1/trainer_pb.js`.
export { CoordinatorClient, hasEnded, type RunSpecInit } from "./coordinator.js";
export { Code, PipelineError, fromCallError, fromStatus, type FieldViolation } from "./errors.js";
export { GenerateSession, InferenceClient, type GenerateOptions, type SubmissionInit } from "./inference.js";
export { createTransport, type ConnectOptions, type TlsOptions } from "./transport.js";
