"""An inference server over the fake engine (a token per 10 ms), advertising the limits it is
given; writes its port to a file, serves until SIGTERM, which drains it as the real one is drained.

Run as `python fake_inference_server.py PORT_FILE MAX_NEW_TOKENS MAX_CONTEXT [PORT]` by
test_coordinator_start.py and test_inference_pool.py.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from pipelinerl.common.log import configure_logging
from pipelinerl.common.server import GrpcServer
from pipelinerl.common.settings import ServiceSettings
from pipelinerl.inference.server import InferenceServicer, registration
from pipelinerl.inference.types import Limits
from tests.fakes import FakeBackend


async def main(port_file: Path, max_new_tokens: int, max_context: int, port: int) -> None:
    backend = FakeBackend(step_s=0.01)
    backend.limits = Limits(max_running=4, max_new_tokens=max_new_tokens, max_context=max_context)
    servicer = InferenceServicer(backend)
    settings = ServiceSettings(port=port, drain_seconds=10)
    server = GrpcServer(settings, [registration(servicer)], on_drain=[servicer.drain])

    async def announce() -> None:
        while server.port == 0:
            await asyncio.sleep(0.01)
        port_file.write_text(str(server.port))

    announcer = asyncio.create_task(announce())
    await server.serve_until_signal()
    await announcer


if __name__ == "__main__":
    configure_logging("inference")
    port = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    asyncio.run(main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), port))
