"""The shop (shop.py) served in OpenEnv's protocol (openenv-core, https://github.com/meta-pytorch/OpenEnv): an
MCP environment whose tools are the shop's `stock` and `answer`, each WebSocket session an episode of its own.
Each call's reward is the change it made to the shop's score, so an episode's return (the sum, what the toolkit
scores it by) is the score the shop's get_reward gives at its end in-process: the same episodes, a second answer
included, score the same served or not. It runs in OpenEnv's own environment, which
`make install` builds beside the toolkit's (.venv-openenv: openenv-core brings FastAPI, Gradio and an MCP server,
none of which training needs):

    .venv-openenv/bin/python recipes/environments/shop_openenv.py --port 8000
    python recipes/smollm2_grpo_env.py --environment http://127.0.0.1:8000 ...
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import uvicorn
from fastmcp import FastMCP
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
from openenv.core.env_server.types import Observation, State

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shop import Shop  # noqa: E402  (the same shop the in-process recipe plays)


class ShopEnvironment(MCPEnvironment):
    """The shop, one per session."""

    SUPPORTS_CONCURRENT_SESSIONS = True  # each session builds its own: nothing is shared

    def __init__(self) -> None:
        self.shop, self.steps, self.score = Shop(), 0, 0.0
        server = FastMCP("shop")
        for tool in (self.shop.stock, self.shop.answer):
            server.tool(tool)  # its name, docstring and signature: the schema the in-process shop offers
        super().__init__(server)

    def reset(self, seed=None, episode_id=None, items=None, counts=None, **row) -> Observation:
        self.shop.reset(items, counts)
        self.steps, self.score = 0, self.shop.get_reward()
        return Observation(done=False, reward=None)

    async def step_async(self, action, timeout_s=None, **kwargs) -> Observation:
        observation = await super().step_async(action, timeout_s=timeout_s, **kwargs)
        if isinstance(action, CallToolAction):  # not listing the tools
            self.steps += 1
            score = self.shop.get_reward()
            observation.reward, self.score = score - self.score, score
        return observation

    def _step_impl(self, action, timeout_s=None, **kwargs) -> Observation:
        raise ValueError(f"the shop takes tool calls only, not {type(action).__name__}")

    @property
    def state(self) -> State:
        return State(step_count=self.steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--sessions", type=int, default=64, help="episodes open at once (a step's rollouts)")
    args = parser.parse_args()
    app = create_app(ShopEnvironment, CallToolAction, CallToolObservation, env_name="shop",
                     max_concurrent_envs=args.sessions)  # fmt: skip
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
