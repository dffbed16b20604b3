"""Command-line tools of kvcached-core (``kvctl``)."""
