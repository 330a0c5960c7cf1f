"""meshlm.launch: the `meshlm` command line (imports heavy components lazily)."""
