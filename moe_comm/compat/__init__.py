"""Modules that present moe-comm under another library's import name (``deep_ep``), for code that
imports that library directly. Importing them changes nothing; ``moe_comm.integrations`` installs
them under those names, on request."""
