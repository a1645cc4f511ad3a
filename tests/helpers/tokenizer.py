"""A tiny byte-level BPE tokenizer for tests, trained on the fly from a fixed corpus.

Byte-level means every byte has a token, so any string round-trips through encode and decode, and a token can end
in the middle of a multi-byte UTF-8 character (which is what the incremental detokenizer must cope with).
Training on a fixed corpus with fixed settings gives the same vocabulary and merges on every run.
"""

from __future__ import annotations

from pathlib import Path

from training.data import train_tokenizer

PAD_TOKEN = "<|pad|>"
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
# Their order gives their ids: pad 0, bos 1, eos 2.
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)

CORPUS = '''\
The quick brown fox jumps over the lazy dog. A speculative decoder guesses several tokens with a small draft
model, then the large target model checks all of them in one forward pass. When the draft is right, the target
accepts the guesses and the answer arrives sooner; when it is wrong, the target corrects the first mistake and
nothing is lost. The output is the same as if the target had worked alone, one token at a time.

Once upon a time there was a little server that answered questions. Every morning it loaded its weights, opened
its ports and waited for requests. Some people asked for poems, others for code, and a few only wanted to know
the time. The server did its best for all of them, and it never forgot to close the stream at the end.

def fibonacci(count: int) -> list[int]:
    """Returns the first count Fibonacci numbers."""
    numbers = [0, 1]
    while len(numbers) < count:
        numbers.append(numbers[-1] + numbers[-2])
    return numbers[:count]


class Counter:
    def __init__(self) -> None:
        self.total = 0

    def add(self, value: int) -> int:
        if value < 0:
            raise ValueError(f"value must be >= 0, got {value}")
        self.total += value
        return self.total


for index, word in enumerate(["alpha", "beta", "gamma"]):
    print(index, word.upper())

import math

def distance(x: float, y: float) -> float:
    return math.sqrt(x * x + y * y)

Question: What is the capital of France?
Answer: The capital of France is Paris.
Question: How many legs does a spider have?
Answer: A spider has eight legs.
Question: Why is the sky blue?
Answer: Air scatters blue light more strongly than red light, so the sky looks blue from every direction.

async def stream_tokens(client, request):
    async for response in client.generate(request):
        if response.finish_reason:
            return response.stats
        yield response.text


with open("notes.txt", "w", encoding="utf-8") as handle:
    handle.write("first line")
    handle.write("second line")

Dear team, the results of this week are in. The new draft model accepts more tokens on code than on chat, and
the latency of the first token did not change. Next week we will try longer prompts, larger batches and a second
draft replica, and we will write down what we learn in the usual place.
'''


def write_tokenizer(directory: Path, vocab_size: int = 320) -> None:
    """Trains the tokenizer and saves it where transformers.AutoTokenizer.from_pretrained(directory) finds it.

    The vocabulary holds at most vocab_size tokens: 256 bytes, the special tokens, then merges learned from CORPUS.
    """
    tokenizer = train_tokenizer(
        [CORPUS], vocab_size, SPECIAL_TOKENS, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN
    )
    tokenizer.save_pretrained(directory)
