"""The engine: ``core/`` the step loop and request life cycle, ``worker/`` what runs on the
device, ``loader/`` model files, ``model/`` model code, ``text/`` tokenizer and detokenizer,
``structured/`` grammars, ``entrypoints/`` and ``serve/`` the ways in.

Installed as ``tokenbudget.engine``; the public names are re-exported by ``tokenbudget``.
"""

if __name__ != "tokenbudget.engine":  # a second copy of every module would be loaded
    raise ImportError("this folder installs as tokenbudget.engine: `import tokenbudget` instead")
