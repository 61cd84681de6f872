"""Drive PipelineRL from stubs generated out of `protos/` alone: no import of the `pipelinerl` package.

    python example.py generate --address 127.0.0.1:50051 --prompt "12+30="
    python example.py run --address 127.0.0.1:50050 --max-samples 256

It compiles the contracts with grpcio-tools into a temporary folder, imports the generated modules
from there, and uses nothing else but grpcio and protobuf. `generate` streams one completion from an
inference server with its per-token logprobs and weight versions; `run` starts a run on a
coordinator and prints its progress until it ends. Both print one JSON line at the end.
`--token` sends the bearer token; `--tls-ca` speaks TLS, verified with that CA bundle.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import tempfile
from importlib import resources
from pathlib import Path
from types import ModuleType

import grpc
from grpc_tools import protoc

PROTOS = Path(__file__).resolve().parents[2] / "protos"


def compile_stubs(out: Path) -> None:
    """`*_pb2.py` and `*_pb2_grpc.py` of every contract under `out`, then importable."""
    sources = sorted(str(p.relative_to(PROTOS)) for p in PROTOS.rglob("*.proto"))
    well_known = str(resources.files("grpc_tools") / "_proto")
    args = ["protoc", f"-I{PROTOS}", f"-I{well_known}", f"--python_out={out}", f"--grpc_python_out={out}"]
    if protoc.main([*args, *sources]) != 0:
        raise SystemExit("protoc failed")
    sys.path.insert(0, str(out))


def stubs(name: str) -> tuple[ModuleType, ModuleType]:
    """The message and service modules of `pipelinerl.<name>.v1`."""
    package = f"pipelinerl.{name}.v1.{name}"
    return importlib.import_module(f"{package}_pb2"), importlib.import_module(f"{package}_pb2_grpc")


def open_channel(args: argparse.Namespace) -> grpc.Channel:
    if args.tls_ca is None:
        return grpc.insecure_channel(args.address)
    return grpc.secure_channel(args.address, grpc.ssl_channel_credentials(Path(args.tls_ca).read_bytes()))


def metadata(args: argparse.Namespace) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {args.token}")] if args.token else []


def generate(args: argparse.Namespace) -> dict:
    pb, pb_grpc = stubs("inference")
    common, _ = stubs("common")
    submit = pb.Submission(
        request_id="example",
        prompt_text=args.prompt,
        sampling=common.SamplingParams(max_new_tokens=args.max_new_tokens, seed=1),
        stream_tokens=True,
    )
    deltas: list[int] = []
    with open_channel(args) as channel:
        responses = pb_grpc.InferenceServiceStub(channel).Generate(
            iter([pb.GenerateRequest(submit=submit)]), metadata=metadata(args), timeout=args.timeout_s
        )
        for response in responses:
            event = response.WhichOneof("event")
            if event == "capacity":
                info = response.capacity.model_info
                print(f"model {info.model}: vocab {info.vocab_size}, eos {list(info.eos_token_ids)}")
            elif event == "delta":
                deltas.extend(response.delta.tokens.token_ids)
            elif event == "error":
                raise SystemExit(f"request failed: {response.error.status.message}")
            elif event == "completion":
                done = response.completion
                tokens = done.completion
                return {
                    "text": done.text,
                    "token_ids": list(tokens.token_ids),
                    "logprobs": [round(lp, 4) for lp in tokens.logprobs],
                    "versions": list(tokens.versions),
                    "streamed_token_ids": deltas,
                    "finish_reason": common.FinishReason.Name(done.finish_reason),
                }
    raise SystemExit("the stream ended without a completion")


def run(args: argparse.Namespace) -> dict:
    pb, pb_grpc = stubs("coordinator")
    common, _ = stubs("common")
    spec = pb.RunSpec(
        dataset=args.dataset,
        group_size=args.group_size,
        max_samples=args.max_samples,
        sampling=common.SamplingParams(max_new_tokens=args.max_new_tokens),
        mode=pb.MODE_PIPELINE,
        max_in_flight=args.max_in_flight,
    )
    with open_channel(args) as channel:
        stub = pb_grpc.CoordinatorServiceStub(channel)
        started = stub.StartRun(
            pb.StartRunRequest(run_id=args.run_id, spec=spec), metadata=metadata(args), timeout=30
        )
        run_id = started.run.run_id
        last = started.run
        for update in stub.WatchRun(
            pb.WatchRunRequest(run_id=run_id), metadata=metadata(args), timeout=args.timeout_s
        ):
            last = update.run
            p, state = last.progress, pb.RunState.Name(last.state)
            print(f"{state} trained {p.trained} reward {p.reward_mean:.2f} version {p.trainer_version}")
    p = last.progress
    return {
        "run_id": run_id,
        "state": pb.RunState.Name(last.state),
        "trained": p.trained,
        "dropped": p.dropped,
        "reward_mean": p.reward_mean,
        "trainer_version": p.trainer_version,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("command", choices=["generate", "run"])
    parser.add_argument("--address", required=True, help="host:port of the inference server or coordinator")
    parser.add_argument("--token", default="", help="bearer token, when the server requires one")
    parser.add_argument("--tls-ca", default=None, help="CA bundle: speak TLS and verify the server with it")
    parser.add_argument("--timeout-s", type=float, default=600)
    parser.add_argument("--prompt", default="12+30=")
    parser.add_argument("--max-new-tokens", type=int, default=3)
    parser.add_argument("--run-id", default="")
    parser.add_argument("--dataset", default="builtin:copy:2")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-samples", type=int, default=256)
    parser.add_argument("--max-in-flight", type=int, default=256)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as out:
        compile_stubs(Path(out))
        result = generate(args) if args.command == "generate" else run(args)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
