"""A reward server whose Score takes `delay` seconds; writes its port to a file, serves until SIGTERM.

Run as `python slow_reward_server.py PORT_FILE DELAY_S` by test_shutdown.py.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from pipelinerl.common.log import configure_logging
from pipelinerl.common.server import GrpcServer
from pipelinerl.common.settings import ServiceSettings
from pipelinerl.reward.server import registration
from tests.fakes import FakeReward


async def main(port_file: Path, delay_s: float) -> None:
    server = GrpcServer(ServiceSettings(port=0, drain_seconds=10), [registration(FakeReward(delay_s))])

    async def announce() -> None:
        while server.port == 0:
            await asyncio.sleep(0.01)
        port_file.write_text(str(server.port))

    announcer = asyncio.create_task(announce())
    await server.serve_until_signal()
    await announcer


if __name__ == "__main__":
    configure_logging("reward")
    asyncio.run(main(Path(sys.argv[1]), float(sys.argv[2])))
