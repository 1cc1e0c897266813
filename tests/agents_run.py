"""One OpenAI Agents SDK weather agent, run against the gateway, for every test that needs it.

The SDK is imported inside the functions: a test module that uses it stays importable (and
says why it skips) where the SDK is not installed.
"""

from __future__ import annotations

from typing import Any

import openai

PROMPT = "What is the weather in Oslo?"


def weather_tool(seen: list[str], city_type: Any = str) -> Any:
    """A ``get_weather`` function tool that records the cities it is called with.

    ``city_type``: the argument's type; a random-weight model needs an enum (``Literal``),
    since the grammar for a free JSON string lets it write control characters."""
    from agents import function_tool

    def get_weather(city: str) -> str:
        """Current weather in a city."""
        seen.append(city)
        return f"Sunny in {city}"

    get_weather.__annotations__["city"] = city_type
    return function_tool(get_weather)


async def run_weather_agent(url: str, api_key: str, model: str, *, responses: bool,
                            seen: list[str], city_type: Any = str, stream: bool = False,
                            max_turns: int = 4, **agent_options: Any) -> Any:
    """Build the agent on the gateway at ``url`` with the Responses or the Chat Completions
    model class, run it (streamed: every event consumed) and return the run's result."""
    import agents

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0,
                                timeout=300)
    model_class = (agents.OpenAIResponsesModel if responses
                   else agents.OpenAIChatCompletionsModel)
    try:
        agent = agents.Agent(
            name="weather", instructions="Answer with the weather.",
            tools=[weather_tool(seen, city_type)],
            model=model_class(model=model, openai_client=client), **agent_options)
        if not stream:
            return await agents.Runner.run(agent, PROMPT, max_turns=max_turns)
        run = agents.Runner.run_streamed(agent, PROMPT, max_turns=max_turns)
        async for _ in run.stream_events():
            pass
        return run
    finally:
        await client.close()
