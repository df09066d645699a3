"""The server as a process: running it, supervising a pipeline of ranks, the stand-in."""
