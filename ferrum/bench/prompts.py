"""Prompt text for the workloads: raw Gemma-formatted turns sent through `/v1/completions`.

Raw text rather than chat messages: every server then sees the same characters, whatever its
chat template handling, and tokenizes them itself (counts are read back, never assumed).
A round's prompts come from one seeded generator, so every arm of a round gets the same text;
a random tag at the front of each unrelated prompt keeps any prefix cache from helping.
"""

from __future__ import annotations

import random

_WORD_TEXT = """
    lighthouse badger comet violin glacier teapot falcon orchard lantern canyon robot meadow
    harbor dragon pebble volcano compass otter castle thunder marble cactus river wizard
    saturn biscuit forest kettle pirate umbrella zeppelin quartz
"""
WORDS = tuple(_WORD_TEXT.split())
TOPICS = (
    "deliveries",
    "opening hours",
    "refunds",
    "gift cards",
    "allergens",
    "catering",
    "parking",
    "loyalty points",
    "recipes",
    "bulk orders",
    "holidays",
    "payment methods",
)


def gemma_turn(user: str) -> str:
    """One user turn and the opening of the model's turn, as Gemma's template renders them."""
    return f"<start_of_turn>user\n{user}<end_of_turn>\n<start_of_turn>model\n"


def end_model_turn(reply: str) -> str:
    return f"{reply}<end_of_turn>\n"


class PromptSource:
    """All prompt text of one round, reproducible from (seed, round)."""

    def __init__(self, seed: str, round_no: int, workload: str):
        self.rng = random.Random(f"{seed}-{round_no}-{workload}")
        self._counter = 0

    def tag(self) -> str:
        return f"{self.rng.getrandbits(32):08x}"

    def unrelated(self) -> str:
        """A short prompt that shares nothing beyond its first tokens with any other."""
        self._counter += 1
        word = self.rng.choice(WORDS)
        return gemma_turn(f"[{self.tag()}] Write a story about {word} number {self._counter}.")

    def handbook(self, rules: int) -> str:
        """A made-up shop handbook, ~37 Gemma tokens a rule, different on every call."""
        rng = self.rng
        shop = f"{rng.choice(['Harbor', 'Meadow', 'Comet', 'Falcon', 'Orchard'])} {self.tag()}"
        lines = [f"You are the assistant of the {shop} bakery. Follow this handbook."]
        for i in range(rules):
            topic = TOPICS[i % len(TOPICS)]
            lines.append(
                f"Rule {i + 1} about {topic}: staff answer questions on {topic} politely, quote "
                f"the price list for item {rng.randint(100, 999)}, and never promise more than "
                f"{rng.randint(2, 9)} days."
            )
        return "\n".join(lines)

    def burst(self, prefix: str, clients: int, label: str) -> list[str]:
        """`clients` prompts that share `prefix` and differ only in the final question."""
        return [
            gemma_turn(f"{prefix}\n\nQuestion {label}-{i}: what about item {100 + i}?")
            for i in range(clients)
        ]

    def conversation_opening(self, k: int) -> str:
        return f"Conversation {self.tag()} with customer {k}.\n"

    def next_question(self, turn: int) -> str:
        return gemma_turn(f"Turn {turn}: tell me about {self.rng.choice(TOPICS)}.")

    def long_prompt(self, rules: int) -> str:
        return gemma_turn(f"{self.handbook(rules)}\n\nSummarise the handbook in one sentence.")
