"""Engine code the LLM services share (tokenizer, prefill, decode): the model and its
artifacts, the KV cache and its wire codec, sampling and stopping. Not a service itself,
and free of grpc: servicers live in services/<name>/.
"""
