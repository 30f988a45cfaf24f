"""The `jaxseek` command: the entry point above every other package."""
