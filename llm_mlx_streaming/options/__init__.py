"""Every knob declared once, the settings file and llm's options built from it, the
registry of added models, and `configure`: options over settings -> RunConfig."""
