"""Text in and out: the tokenizer (with chat templates) and the incremental detokenizer."""
