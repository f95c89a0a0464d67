"""Plugs into the systems users already run: ``integrations/ray/`` (Ray Data offline batches,
Ray Serve replicas). Installed as ``tokenbudget.integrations``; each integration imports its
third-party package only when used (extras ``[ray]``, ``[router]``)."""
