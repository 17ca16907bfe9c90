"""vLLM's `vllm.inputs` names: `from jaxinfer.inputs import TokensPrompt` as `from vllm.inputs import TokensPrompt`."""
from jaxinfer.prompts import TextPrompt, TokensPrompt

PromptType = str | TextPrompt | TokensPrompt | list[int]    # what LLM.generate takes as one prompt (vLLM's name)
SingletonPrompt = PromptType

__all__ = ["PromptType", "SingletonPrompt", "TextPrompt", "TokensPrompt"]
