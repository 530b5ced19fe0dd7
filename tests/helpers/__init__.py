"""Test helpers: ``spawn`` runs a function on N local processes joined in one process group."""
