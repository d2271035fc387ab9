"""Sans-I/O wire codecs: bytes in, events out. They import neither the core nor any shell."""
