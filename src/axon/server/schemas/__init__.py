"""Request and response bodies: pydantic schemas of the OpenAI, Anthropic and node APIs, the
checks of their free-form parts, and the builders of OpenAI response bodies."""
