// Status details decode into typed errors, with no server.
import assert from "node:assert/strict";
import { test } from "node:test";
import { create, toBinary } from "@bufbuild/protobuf";
import { anyPack } from "@bufbuild/protobuf/wkt";
import { ConnectError } from "@connectrpc/connect";
import { BadRequestSchema } from "../src/gen/google/rpc/error_details_pb.js";
import { StatusSchema } from "../src/gen/google/rpc/status_pb.js";
import { Code, PipelineError, fromCallError, fromStatus } from "../src/index.js";

const badRequest = create(BadRequestSchema, {
  fieldViolations: [{ field: "submit.prompt_token_ids[1]", description: "must be below 100" }],
});
const violations = [{ field: "submit.prompt_token_ids[1]", description: "must be below 100" }];

test("a RequestError's google.rpc.Status becomes a PipelineError with its field violations", () => {
  const status = create(StatusSchema, {
    code: Code.InvalidArgument,
    message: "submit.prompt_token_ids[1]: must be below 100",
    details: [anyPack(BadRequestSchema, badRequest)],
  });
  const error = fromStatus(status);
  assert.ok(error instanceof PipelineError);
  assert.equal(error.code, Code.InvalidArgument);
  assert.equal(error.message, "submit.prompt_token_ids[1]: must be below 100");
  assert.deepEqual(error.violations, violations);
});

test("a call's error keeps its code and decodes the BadRequest of its status details", () => {
  const received = new ConnectError("bad prompt", Code.InvalidArgument);
  received.details = [{ type: BadRequestSchema.typeName, value: toBinary(BadRequestSchema, badRequest) }];
  const error = fromCallError(received);
  assert.equal(error.code, Code.InvalidArgument);
  assert.equal(error.message, "bad prompt");
  assert.deepEqual(error.violations, violations);
});

test("an error without details has no violations; one that is not a call's is UNKNOWN", () => {
  assert.deepEqual(fromCallError(new ConnectError("gone", Code.Unavailable)).violations, []);
  assert.equal(fromCallError(new Error("boom")).code, Code.Unknown);
});
