"""The HTTP routes: OpenAI (chat, completions, responses, embeddings), Anthropic Messages,
vLLM's utility routes and the node-management API. Each module holds one API's router."""
