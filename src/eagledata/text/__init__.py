"""Text side of a model: how its prompts and completions are written as tokens.

* ``families``: model families (special-token names, thinking, tool-call markup, tool declaration);
* ``tokenizer``: tokenizers loaded from their data files (tiktoken ranks or HF ``tokenizer.json``),
  self-checked special ids, Kimi's long-input splitting;
* ``chat``: prompt rendering with the model's chat template (a Hugging Face compatible Jinja
  environment), tools declared as the model's own tokenizer code declares them;
* ``tool_declaration``: the TypeScript-style tool declaration of Kimi K2.5 / K2 Thinking.
"""
