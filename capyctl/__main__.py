"""``python -m capyctl`` runs the CLI."""

from capyctl.cli import main

main()
