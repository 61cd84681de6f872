// Streams one completion from an inference server: its token ids as they are generated, then each
// token with its logprob and the weight version that produced it. The last line is JSON.
//
//   node dist/examples/generate.js --address 127.0.0.1:50051 [--prompt "12+30="] [--max-new-tokens 8]
//                                  [--token TOKEN] [--tls-ca ca.pem]
import { parseArgs } from "node:util";
import { FinishReason } from "../src/gen/pipelinerl/common/v1/common_pb.js";
import { InferenceClient } from "../src/index.js";
import { connectOptions, transportOf } from "./cli.js";

const { values } = parseArgs({
  options: {
    ...connectOptions,
    prompt: { type: "string", default: "12+30=" },
    "max-new-tokens": { type: "string", default: "8" },
  },
});
const transport = transportOf(values);
const session = await new InferenceClient(transport).session();
const info = session.capacity.modelInfo!;
console.log(`${info.model}: vocabulary ${info.vocabSize}, EOS ${info.eosTokenIds.join(",")}`);
const streamed: number[] = [];
try {
  const completion = await session.generate(
    { promptText: values.prompt, sampling: { maxNewTokens: Number(values["max-new-tokens"]), seed: 1n } },
    { onDelta: (tokens) => streamed.push(...tokens.tokenIds) },
  );
  const tokens = completion.completion!;
  tokens.tokenIds.forEach((id, i) => {
    console.log(`token ${id}  logprob ${tokens.logprobs[i].toFixed(4)}  version ${tokens.versions[i]}`);
  });
  const result = {
    text: completion.text,
    finishReason: FinishReason[completion.finishReason],
    tokenIds: tokens.tokenIds,
    logprobs: tokens.logprobs,
    versions: tokens.versions.map(Number),
    streamedTokenIds: streamed,
  };
  console.log(JSON.stringify(result));
} finally {
  await session.closeWhenIdle();
}
