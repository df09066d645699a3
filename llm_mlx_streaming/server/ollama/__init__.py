"""Ollama's routes."""
