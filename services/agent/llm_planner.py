"""The model picks the tool: a chat turn whose output is constrained (guided choice) to
the tool names or "answer", so it always parses. The arguments come from the question
by the same extractors the rule planner uses, so they always validate; when the model's
pick has no arguments in the question, the plan is unusable and the rules act instead."""

from __future__ import annotations

from aimesh.llm.v1 import generation_pb2, generation_pb2_grpc, sampling_pb2
from services.agent.planner import MAX_QUERY, ToolStep, arithmetic_in, digit_in, dotted_name_in

ANSWER = "answer"
SYSTEM = (
    "You route a user's question to one tool. Tools:\n{tools}\n"
    f"- {ANSWER}: reply directly, no tool needed.\n"
    "Reply with the tool's name only."
)

# Worked examples as earlier chat turns: a 135M model routes far better from examples
# than from descriptions alone.
EXAMPLES = (
    ("What is 12*7+3?", "calculator"),
    ("How do I sort a dictionary by its values?", "knowledge_search"),
    ("What does os.path.join do?", "python_doc"),
    ("Draw the digit 5", "generate_image"),
    ("How can I read a file line by line?", "knowledge_search"),
    ("Compute 2^8 - 1", "calculator"),
    ("Hello!", ANSWER),
)


def arguments_for(tool: str, question: str) -> dict | None:
    """The tool's arguments taken from the question; None when it holds none."""
    if tool == "calculator":
        expression = arithmetic_in(question)
        return {"expression": expression} if expression else None
    if tool == "python_doc":
        name = dotted_name_in(question)
        return {"name": name} if name else None
    if tool == "generate_image":
        digit = digit_in(question)
        return {"prompt": digit} if digit is not None else None
    if tool == "knowledge_search":
        return {"query": question[:MAX_QUERY]} if question.strip() else None
    return None


async def choose(
    stub: generation_pb2_grpc.GenerationServiceStub,
    question: str,
    tools: dict[str, str],
    request_id: str,
) -> str:
    """The model's pick among `tools` (name -> description) and ANSWER."""
    listing = "\n".join(f"- {name}: {description}" for name, description in sorted(tools.items()))
    request = generation_pb2.ChatRequest(
        request_id=request_id,
        messages=[
            {"role": "system", "content": SYSTEM.format(tools=listing)},
            *(
                {"role": role, "content": content}
                for example, pick in EXAMPLES
                if pick in tools or pick == ANSWER
                for role, content in (("user", example), ("assistant", pick))
            ),
            {"role": "user", "content": question},
        ],
        sampling=sampling_pb2.SamplingParameters(choices=[*sorted(tools), ANSWER]),
    )
    text = ""
    async for message in stub.Chat(request):
        if message.HasField("chunk"):
            text += message.chunk.text
    return text


def step_for(choice: str, question: str) -> ToolStep | None:
    arguments = arguments_for(choice, question)
    if arguments is None:
        return None
    return ToolStep(choice, arguments, f"{choice} (the model's choice)")
