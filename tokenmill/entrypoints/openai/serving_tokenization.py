"""POST /tokenize and /detokenize (vLLM's shapes)."""
from __future__ import annotations

from typing import Any

from tokenmill.entrypoints.openai.protocol_tokenization import (DetokenizeRequest, DetokenizeResponse,
                                                                TokenizeChatRequest, TokenizeRequest,
                                                                TokenizeResponse)
from tokenmill.entrypoints.openai.serving_chat import ChatRenderer
from tokenmill.entrypoints.openai.serving_engine import OpenAIServing, ServingError


class OpenAIServingTokenization(OpenAIServing):

    def __init__(self, *args: Any, renderer: ChatRenderer | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.renderer = renderer or ChatRenderer(self.tokenizer, self.frontend)

    def _need_tokenizer(self) -> None:
        if self.tokenizer is None:
            raise ServingError("This server was started with skip_tokenizer_init: it has no tokenizer.", 400)

    async def create_tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        self.check_model(request.model)
        self._need_tokenizer()
        if isinstance(request, TokenizeChatRequest):
            text = self.renderer.render(request.messages, request_template=request.chat_template,
                                        add_generation_prompt=request.add_generation_prompt,
                                        continue_final_message=request.continue_final_message, tools=request.tools,
                                        request_kwargs=request.chat_template_kwargs, documents=request.documents)
        else:
            text = request.prompt
        ids = await self.tokenize_async(text, request.add_special_tokens)
        token_strs = None
        if request.return_token_strs:
            token_strs = list(self.tokenizer.convert_ids_to_tokens(ids))
        return TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids, token_strs=token_strs)

    async def create_detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(request.model)
        self._need_tokenizer()
        self.check_token_ids(request.tokens, "tokens")
        try:
            text = self.tokenizer.decode(request.tokens)
        except Exception as e:  # ids the tokenizer does not know (a model vocabulary padded past it)
            raise ServingError(f"Cannot detokenize these tokens: {e}", 400, "tokens") from None
        return DetokenizeResponse(prompt=text)
