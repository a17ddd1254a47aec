"""Speculative decoding: proposers of draft tokens and the rejection sampler that verifies them (vLLM V1's
vllm/v1/spec_decode/ and vllm/v1/sample/rejection_sampler.py)."""
