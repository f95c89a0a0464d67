"""Plugs into the systems users already run: ``integrations/ray/`` (Ray Data offline batches,
Ray Serve replicas). Installed as ``tokenbudget.integrations``; each integration imports its
third-party package only when used (extras ``[ray]``, ``[router]``)."""

if __name__ != "tokenbudget.integrations":  # a second copy of every module would be loaded
    raise ImportError("this folder installs as tokenbudget.integrations: `import tokenbudget` instead")
