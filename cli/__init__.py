"""The ``tokenbudget`` console script (``main``) and its sub-commands, one module each."""

if __name__ != "tokenbudget.cli":  # a second copy of every module would be loaded
    raise ImportError("this folder installs as tokenbudget.cli: `import tokenbudget` instead")
