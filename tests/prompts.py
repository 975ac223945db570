"""Real prompts for end-to-end tests (chat-formatted at use)."""

PROMPTS = [
    "Write a Python function that reverses a string.",
    "What is the capital of France? Answer in one sentence.",
    "Explain what a hash table is to a beginner.",
    "List three fruits that are red.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"",
    "Translate 'good morning' into Spanish and German.",
    "Write a haiku about the ocean.",
    "How many legs does a spider have?",
    "Give me a SQL query that counts rows in a table named users.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
]
