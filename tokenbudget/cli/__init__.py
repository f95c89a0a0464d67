"""The ``tokenbudget`` console script (``main``) and its sub-commands, one module each."""
