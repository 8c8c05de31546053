"""Varied prompts for equivalence tests: plain and chat, from a few tokens to a few hundred."""

LONG_TEXT = (
    "Inference engines keep a paged pool of key and value vectors. Each request owns a row of slot "
    "indices; the scheduler admits requests while the pool has room, splits long prompts into chunks, "
    "and mixes those chunks with the decode steps of requests already running. When the pool runs out, "
    "the most recent request is preempted and later recomputed from its prompt and the tokens it had. "
)

PLAIN = [
    "The capital of France is",
    "1, 2, 3, 4, 5,",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "Translate to French: I like apples.",
    "Q: What is 12 times 7?\nA:",
    LONG_TEXT * 4 + "\nSummarize the text above in one sentence:",
    "The three primary colors are",
]

CHATS = [
    [{"role": "user", "content": "Write a haiku about autumn."}],
    [{"role": "user", "content": "What is the boiling point of water?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three planets."}],
    [{"role": "user", "content": "Explain what a hash map is in two sentences."}],
    [{"role": "user", "content": LONG_TEXT * 3 + "\nWhat happens when the pool runs out?"}],
    [{"role": "user", "content": "hi"}],
    [{"role": "user", "content": "List the days of the week."}, {"role": "assistant", "content": "Monday,"},
     {"role": "user", "content": "Continue."}],
    [{"role": "user", "content": "Write a Python function that reverses a string."}],
]

PROMPTS = PLAIN + CHATS

# Prompts the peer engines (vLLM, llama.cpp) are probed with.
PLAIN = ["The capital of France is", "def fibonacci(n):", "The three primary colours are",
         "Water boils at a temperature of", "Once upon a time, in a small village,",
         "The quick brown fox", "In 1969, the first person to walk on the Moon was", "1, 2, 3, 5, 8, 13,"]
CHAT = ["What is the capital of Italy?", "Write a haiku about autumn.", "Explain what a CPU does in one sentence.",
        "List three fruits.", "How many legs does a spider have?", "Say hello in French.",
        "What is 12 times 12?", "Give me a name for a black cat."]
