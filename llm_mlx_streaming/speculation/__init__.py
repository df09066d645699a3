"""Speculative decoding: drafters propose tokens, one pass of the streamed model verifies them."""
