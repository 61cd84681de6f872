// Starts a run on the built-in task through a coordinator, prints its progress about once a second,
// and exits once the run has ended: 0 when it completed its budget. The last line is JSON.
//
//   node dist/examples/start-run.js --address 127.0.0.1:50050 [--max-samples 256] [--run-id ID]
//                                   [--token TOKEN] [--tls-ca ca.pem]
import { parseArgs } from "node:util";
import { Mode, RunState, type Run } from "../src/gen/pipelinerl/coordinator/v1/coordinator_pb.js";
import { CoordinatorClient } from "../src/index.js";
import { connectOptions, transportOf } from "./cli.js";

const { values } = parseArgs({
  options: {
    ...connectOptions,
    "max-samples": { type: "string", default: "256" },
    "run-id": { type: "string", default: "" },
  },
});
const transport = transportOf(values);
const spec = {
  dataset: "builtin:copy:2",
  groupSize: 8,
  maxSamples: BigInt(values["max-samples"]),
  sampling: { maxNewTokens: 3 },
  mode: Mode.PIPELINE,
  maxInFlight: 256,
};
let last: Run | undefined;
for await (const run of new CoordinatorClient(transport).run(spec, { runId: values["run-id"] })) {
  const p = run.progress!;
  const reward = p.rewardMean.toFixed(2);
  console.log(`${RunState[run.state]}  trained ${p.trained}  reward ${reward}  version ${p.trainerVersion}`);
  last = run;
}
const progress = last!.progress!;
const result = {
  runId: last!.runId,
  state: RunState[last!.state],
  trained: Number(progress.trained),
  dropped: Number(progress.dropped),
  rewardMean: progress.rewardMean,
  trainerVersion: Number(progress.trainerVersion),
  error: last!.error,
};
console.log(JSON.stringify(result));
process.exitCode = last!.state === RunState.COMPLETED ? 0 : 1;
