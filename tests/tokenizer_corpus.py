"""The texts every tokenizer test encodes (imported, not a conftest): ``SAMPLES`` (a few mixed
scripts, code, emoji) and ``CORPUS`` (whitespace runs, long repeats, edge cases)."""

SAMPLES = ["Hello world! 12345", "héllo wörld — 世界 你好 🎉👍🏽", "def f(x):\n    return x**2  # ok\n",
           "  leading and trailing spaces  ", "tabs\tand\r\nnewlines\n\n", ""]

CORPUS = ["Hello world", "  leading,   inner   runs\t\ttabs\n\n\nnewlines  \n", " ", "", "a" * 200,
          "x 2024, 3.14159, -42, 1e10, 0x1F, 1,000,000 and 007", "I'm sure we're done, they'll say, it's Bob's",
          "naïve café — “quotes” ¿qué? Ω≈ç√∫ 日本語のテキスト 한국어 🤖👍🏽🎉",
          "\u00a0nbsp\u200bzero width\u3000ideographic",
          "def f(x):\n    return x**2  # ok\n\n\tif y:\r\n        pass", "MiXeD CASE and UPPER WORDS",
          "<|im_start|>user\nhi<|im_end|>\n", "<|endoftext|>text<|im_end|><|im_start|>assistant\n<|im_start|>"]
