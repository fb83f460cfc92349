"""The Textual trace debugger and the `kdtree` command line."""
