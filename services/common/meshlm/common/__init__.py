"""meshlm.common: code every service shares. Never imports torch."""
