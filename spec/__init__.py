"""Speculative decoding: proposers, rejection sampling, metrics, the draft-length controller."""

if __name__ != "tokenbudget.spec":  # a second copy of every module would be loaded
    raise ImportError("this folder installs as tokenbudget.spec: `import tokenbudget` instead")
