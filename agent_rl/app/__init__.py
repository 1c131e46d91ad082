"""The application (layer L3): the CLI (`cli/`), `serve` (scheduler, runners, gateway and web API
in one process), evaluation, the web API (`api/`) and the quickstart. It may import every layer
below; nothing below imports it."""
