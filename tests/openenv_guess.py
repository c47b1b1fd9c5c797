"""An OpenEnv environment that is not an MCP one (tests/test_served_environments.py), served by openenv-core's own
server from .venv-openenv: guess a hidden number, told higher or lower each turn, its one action a pydantic
model with one field. The row's `secret` is the number; a row with `fail` makes reset raise.

    .venv-openenv/bin/python tests/openenv_guess.py --port PORT
"""

from __future__ import annotations

import sys

import uvicorn
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field


class Guess(Action):
    """Guess the hidden number."""

    guess: int = Field(description="A whole number from 1 to 20.")


class Feedback(Observation):
    feedback: str = ""


class GuessEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self.secret, self.steps = 0, 0

    def reset(self, seed=None, episode_id=None, secret: int = 7, fail: bool = False, **row) -> Feedback:
        if fail:
            raise ValueError("this row breaks the environment")
        self.secret, self.steps = int(secret), 0
        return Feedback(feedback="I am thinking of a number from 1 to 20.")

    def step(self, action: Guess, timeout_s=None, **kwargs) -> Feedback:
        self.steps += 1
        if action.guess == self.secret:
            return Feedback(feedback="Right.", done=True, reward=1.0)
        return Feedback(feedback="Higher." if action.guess < self.secret else "Lower.", reward=-0.1)

    @property
    def state(self) -> State:
        return State(step_count=self.steps)


if __name__ == "__main__":
    app = create_app(GuessEnvironment, Guess, Feedback, env_name="guess", max_concurrent_envs=8)
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[sys.argv.index("--port") + 1]), log_level="warning")
