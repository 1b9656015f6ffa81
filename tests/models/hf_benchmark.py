"""PyTorch's Hugging Face benchmark list (`benchmarks/dynamo/huggingface_models_list.txt` in
pytorch/pytorch), each model built from a tiny random configuration of its own family and
class, so that the same code paths run: `--config NAME` with NAME as the list spells it
(`AlbertForMaskedLM`, `meta-llama/Llama-3.2-1B`). Nothing is downloaded.

The forward returns the head's logits (question answering: the start and end logits); the
loss is the next-token loss of token logits (of the decoder's ids for encoder-decoders), or a
made-up label per sample. bench/survey.py's hf suite runs these with tests/models/hf_families.py.
"""

import torch
import torch.nn.functional as F
import transformers
from torch import nn

VOCAB, SEQ, LABELS = 96, 12, 5
_LAYERS = {"num_hidden_layers": 2, "num_attention_heads": 4}
_BERT = {"hidden_size": 32, "intermediate_size": 64, "vocab_size": VOCAB,
         "max_position_embeddings": 64, **_LAYERS}
# encoder-decoders with their LayerDrop probabilities at 0 (transformers' default)
_BART = {"d_model": 32, "encoder_layers": 1, "decoder_layers": 1, "encoder_attention_heads": 4,
         "decoder_attention_heads": 4, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64,
         "vocab_size": VOCAB, "max_position_embeddings": 64, "pad_token_id": 1,
         "decoder_start_token_id": 2, "encoder_layerdrop": 0.0, "decoder_layerdrop": 0.0}
_T5 = {"vocab_size": VOCAB, "d_model": 32, "d_ff": 64, "num_layers": 1, "num_heads": 4,
       "d_kv": 8, "decoder_start_token_id": 0}
_GPT2 = {"n_embd": 32, "n_layer": 2, "n_head": 4, "vocab_size": VOCAB, "n_positions": 64,
         "bos_token_id": 0, "eos_token_id": 0}
_GPTJ = {**_GPT2, "rotary_dim": 4}
_GPT_NEO = {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "window_size": 8,
            "attention_types": [[["global", "local"], 1]], "vocab_size": VOCAB,
            "max_position_embeddings": 64}
_DECODER = {"hidden_size": 32, "intermediate_size": 64, "vocab_size": VOCAB,
            "num_key_value_heads": 2, "head_dim": 8, **_LAYERS}
_DEBERTA = {**_BERT, "relative_attention": True, "pos_att_type": ["p2c", "c2p"],
            "position_buckets": 8, "norm_rel_ebd": "layer_norm", "share_att_key": True,
            "max_relative_positions": -1}
_MOBILEBERT = {**_BERT, "embedding_size": 16, "true_hidden_size": 32,
               "intra_bottleneck_size": 32, "num_feedforward_networks": 2}
_WHISPER = {"vocab_size": VOCAB, "encoder_layers": 1, "decoder_layers": 1,
            "encoder_attention_heads": 4, "decoder_attention_heads": 4, "encoder_ffn_dim": 64,
            "decoder_ffn_dim": 64, "d_model": 32, "max_target_positions": 32, "pad_token_id": 1,
            "decoder_start_token_id": 2, "num_mel_bins": 8, "max_source_positions": 16,
            "bos_token_id": 2, "eos_token_id": 3}

# list name -> (transformers class, its configuration's fields, kind of inputs and outputs)
MODELS = {
    "AlbertForMaskedLM": ("AlbertForMaskedLM", {**_BERT, "embedding_size": 16}, "tokens"),
    "AlbertForQuestionAnswering": ("AlbertForQuestionAnswering",
                                   {**_BERT, "embedding_size": 16}, "qa"),
    "AllenaiLongformerBase": ("LongformerForMaskedLM",
                              {**_BERT, "attention_window": [4, 4], "pad_token_id": 1},
                              "tokens"),
    "BartForCausalLM": ("BartForCausalLM", _BART, "tokens"),
    "BartForConditionalGeneration": ("BartForConditionalGeneration", _BART, "seq2seq"),
    "BertForMaskedLM": ("BertForMaskedLM", _BERT, "tokens"),
    "BertForQuestionAnswering": ("BertForQuestionAnswering", _BERT, "qa"),
    "BlenderbotForCausalLM": ("BlenderbotForCausalLM", _BART, "tokens"),
    "BlenderbotForConditionalGeneration": ("BlenderbotForConditionalGeneration", _BART,
                                           "seq2seq"),
    "BlenderbotSmallForCausalLM": ("BlenderbotSmallForCausalLM", _BART, "tokens"),
    "BlenderbotSmallForConditionalGeneration": ("BlenderbotSmallForConditionalGeneration",
                                                _BART, "seq2seq"),
    "CamemBert": ("CamembertForMaskedLM", {**_BERT, "pad_token_id": 1}, "tokens"),
    "DebertaV2ForMaskedLM": ("DebertaV2ForMaskedLM", _DEBERTA, "tokens"),
    "DebertaV2ForQuestionAnswering": ("DebertaV2ForQuestionAnswering", _DEBERTA, "qa"),
    "DistilBertForMaskedLM": ("DistilBertForMaskedLM",
                              {"dim": 32, "n_layers": 2, "n_heads": 4, "hidden_dim": 64,
                               "vocab_size": VOCAB, "max_position_embeddings": 64}, "tokens"),
    "DistilBertForQuestionAnswering": ("DistilBertForQuestionAnswering",
                                       {"dim": 32, "n_layers": 2, "n_heads": 4,
                                        "hidden_dim": 64, "vocab_size": VOCAB,
                                        "max_position_embeddings": 64}, "qa"),
    "DistillGPT2": ("GPT2LMHeadModel", _GPT2, "tokens"),
    "ElectraForCausalLM": ("ElectraForCausalLM",
                           {**_BERT, "embedding_size": 16, "is_decoder": True}, "tokens"),
    "ElectraForQuestionAnswering": ("ElectraForQuestionAnswering",
                                    {**_BERT, "embedding_size": 16}, "qa"),
    "GPT2ForSequenceClassification": ("GPT2ForSequenceClassification",
                                      {**_GPT2, "pad_token_id": 0, "num_labels": LABELS},
                                      "tokens"),
    "GPTJForCausalLM": ("GPTJForCausalLM", _GPTJ, "tokens"),
    "GPTJForQuestionAnswering": ("GPTJForQuestionAnswering", _GPTJ, "qa"),
    "GPTNeoForCausalLM": ("GPTNeoForCausalLM", _GPT_NEO, "tokens"),
    "GPTNeoForSequenceClassification": ("GPTNeoForSequenceClassification",
                                        {**_GPT_NEO, "pad_token_id": 0, "num_labels": LABELS},
                                        "tokens"),
    "GoogleFnet": ("FNetForMaskedLM", {"hidden_size": 32, "num_hidden_layers": 2,
                                       "intermediate_size": 64, "vocab_size": VOCAB},
                   "tokens"),
    "LayoutLMForMaskedLM": ("LayoutLMForMaskedLM", _BERT, "tokens"),
    "LayoutLMForSequenceClassification": ("LayoutLMForSequenceClassification",
                                          {**_BERT, "num_labels": LABELS}, "tokens"),
    "M2M100ForConditionalGeneration": ("M2M100ForConditionalGeneration", _BART, "seq2seq"),
    "MBartForCausalLM": ("MBartForCausalLM", _BART, "tokens"),
    "MBartForConditionalGeneration": ("MBartForConditionalGeneration", _BART, "seq2seq"),
    "MT5ForConditionalGeneration": ("MT5ForConditionalGeneration", _T5, "seq2seq"),
    "MegatronBertForCausalLM": ("MegatronBertForCausalLM", {**_BERT, "is_decoder": True},
                                "tokens"),
    "MegatronBertForQuestionAnswering": ("MegatronBertForQuestionAnswering", _BERT, "qa"),
    "MobileBertForMaskedLM": ("MobileBertForMaskedLM", _MOBILEBERT, "tokens"),
    "MobileBertForQuestionAnswering": ("MobileBertForQuestionAnswering", _MOBILEBERT, "qa"),
    "OPTForCausalLM": ("OPTForCausalLM",
                       {"hidden_size": 32, "ffn_dim": 64, "word_embed_proj_dim": 32,
                        "vocab_size": VOCAB, "max_position_embeddings": 64, "layerdrop": 0.0,
                        **_LAYERS}, "tokens"),
    "PLBartForCausalLM": ("PLBartForCausalLM", _BART, "tokens"),
    "PLBartForConditionalGeneration": ("PLBartForConditionalGeneration", _BART, "seq2seq"),
    "PegasusForCausalLM": ("PegasusForCausalLM", _BART, "tokens"),
    "PegasusForConditionalGeneration": ("PegasusForConditionalGeneration", _BART, "seq2seq"),
    "RobertaForCausalLM": ("RobertaForCausalLM", {**_BERT, "pad_token_id": 1, "is_decoder": True},
                           "tokens"),
    "RobertaForQuestionAnswering": ("RobertaForQuestionAnswering", {**_BERT, "pad_token_id": 1},
                                    "qa"),
    "T5ForConditionalGeneration": ("T5ForConditionalGeneration", _T5, "seq2seq"),
    # t5-small's layout: as many decoder as encoder layers, relative position buckets shared
    "T5Small": ("T5ForConditionalGeneration", {**_T5, "num_layers": 2}, "seq2seq"),
    "TrOCRForCausalLM": ("TrOCRForCausalLM",
                         {"d_model": 32, "decoder_layers": 2, "decoder_attention_heads": 4,
                          "decoder_ffn_dim": 64, "vocab_size": VOCAB,
                          "max_position_embeddings": 64, "layerdrop": 0.0}, "tokens"),
    "XGLMForCausalLM": ("XGLMForCausalLM",
                        {"d_model": 32, "ffn_dim": 64, "num_layers": 2, "attention_heads": 4,
                         "vocab_size": VOCAB, "max_position_embeddings": 64, "layerdrop": 0.0},
                        "tokens"),
    "XLNetLMHeadModel": ("XLNetLMHeadModel",
                         {"d_model": 32, "n_layer": 2, "n_head": 4, "d_inner": 64,
                          "vocab_size": VOCAB}, "tokens"),
    "YituTechConvBert": ("ConvBertForMaskedLM", _BERT, "tokens"),
    "meta-llama/Llama-3.2-1B": ("LlamaForCausalLM", {**_DECODER, "tie_word_embeddings": True},
                                "tokens"),
    "google/gemma-2-2b": ("Gemma2ForCausalLM",
                          {**_DECODER, "sliding_window": 8, "final_logit_softcapping": 30.0,
                           "attn_logit_softcapping": 50.0}, "tokens"),
    # the multimodal model on text alone, as the list runs it: the vision tower is not read
    "google/gemma-3-4b-it": ("Gemma3ForConditionalGeneration",
                             {"text_config": {**_DECODER, "sliding_window": 8},
                              "vision_config": {"hidden_size": 32, "intermediate_size": 64,
                                                **_LAYERS, "image_size": 16, "patch_size": 4},
                              "mm_tokens_per_image": 4}, "tokens"),
    "openai/whisper-tiny": ("WhisperForConditionalGeneration", _WHISPER, "features"),
    "Qwen/Qwen3-0.6B": ("Qwen3ForCausalLM", {**_DECODER, "tie_word_embeddings": True},
                        "tokens"),
    "mistralai/Mistral-7B-Instruct-v0.3": ("MistralForCausalLM", _DECODER, "tokens"),
    "openai/gpt-oss-20b": ("GptOssForCausalLM",
                           {**_DECODER, "intermediate_size": 32, "num_local_experts": 4,
                            "num_experts_per_tok": 2, "sliding_window": 8}, "tokens"),
}
NAMES = tuple(MODELS)


class Head(nn.Module):
    """A Hugging Face model's logits for token ids (and the decoder's ids, or log-mel
    features and the decoder's ids)."""

    def __init__(self, model: nn.Module, kind: str):
        super().__init__()
        self.model, self.kind = model, kind

    def forward(self, x, y=None):
        if self.kind == "seq2seq":
            return self.model(input_ids=x, decoder_input_ids=y, use_cache=False).logits
        if self.kind == "features":
            return self.model(input_features=x, decoder_input_ids=y, use_cache=False).logits
        out = self.model(input_ids=x)
        if self.kind == "qa":
            return out.start_logits, out.end_logits
        return out.logits


def build_model(config=None):
    if config not in MODELS:
        raise ValueError(f"unknown config {config!r}; expected one of {', '.join(NAMES)}")
    name, fields, kind = MODELS[config]
    cls = getattr(transformers, name)
    return Head(cls(cls.config_class(**fields)), kind)


def example_inputs(model, batch_size):
    ids = torch.randint(3, VOCAB, (batch_size, SEQ))  # above the pad and start ids
    decoder_ids = torch.randint(3, VOCAB, (batch_size, SEQ // 2))
    if model.kind == "seq2seq":
        return (ids, decoder_ids)
    if model.kind == "features":  # (mel bins, frames): twice the encoder's positions
        return (torch.randn(batch_size, 8, 32), decoder_ids)
    return (ids,)


def loss_fn(outputs, batch):
    if isinstance(outputs, tuple):  # start and end logits: a made-up span per sample
        n = outputs[0].shape[0]
        spans = torch.arange(n, device=outputs[0].device) % outputs[0].shape[1]
        return sum(F.cross_entropy(o, spans) for o in outputs)
    if outputs.dim() == 3:  # next-token loss (of the decoder's ids for encoder-decoders)
        ids = batch[-1]
        return F.cross_entropy(outputs[:, :-1].reshape(-1, outputs.size(-1)),
                               ids[:, 1:].reshape(-1))
    labels = torch.arange(outputs.shape[0], device=outputs.device) % outputs.shape[1]
    return F.cross_entropy(outputs, labels)
