"""The model picks the tool: a chat turn whose output is constrained (guided choice) to
the tool names or "answer", so it always parses. The arguments come from the question
by the same extractors the rule planner uses, so they always validate; when the model's
pick has no arguments in the question, the plan is unusable and the rules act instead."""

from __future__ import annotations

from collections.abc import Mapping

from services.agent.planner import (
    CALCULATOR,
    GENERATE_IMAGE,
    KNOWLEDGE_SEARCH,
    PYTHON_DOC,
    Tool,
    ToolStep,
    arguments_for,
)

ANSWER = "answer"
SYSTEM = (
    "You route a user's question to one tool. Tools:\n{tools}\n"
    f"- {ANSWER}: reply directly, no tool needed.\n"
    "Reply with the tool's name only."
)

# Worked examples as earlier chat turns: a 135M model routes far better from examples
# than from descriptions alone.
EXAMPLES = (
    ("What is 12*7+3?", CALCULATOR),
    ("How do I sort a dictionary by its values?", KNOWLEDGE_SEARCH),
    ("What does os.path.join do?", PYTHON_DOC),
    ("Draw the digit 5", GENERATE_IMAGE),
    ("How can I read a file line by line?", KNOWLEDGE_SEARCH),
    ("Compute 2^8 - 1", CALCULATOR),
    ("Hello!", ANSWER),
)


def messages(question: str, tools: Mapping[str, Tool]) -> list[dict[str, str]]:
    """The chat that asks the model to pick among `tools` and ANSWER."""
    listing = "\n".join(f"- {name}: {tools[name].description}" for name in sorted(tools))
    return [
        {"role": "system", "content": SYSTEM.format(tools=listing)},
        *(
            {"role": role, "content": content}
            for example, pick in EXAMPLES
            if pick in tools or pick == ANSWER
            for role, content in (("user", example), ("assistant", pick))
        ),
        {"role": "user", "content": question},
    ]


def choices(tools: Mapping[str, Tool]) -> tuple[str, ...]:
    """What the model's reply is constrained to."""
    return (*sorted(tools), ANSWER)


def step_for(tool: Tool, question: str) -> ToolStep | None:
    """The call of the model's pick, None when the question gives it no arguments."""
    arguments = arguments_for(tool, question)
    why = f"{tool.name} (the model's choice)"
    return None if arguments is None else ToolStep(tool.name, arguments, why)
