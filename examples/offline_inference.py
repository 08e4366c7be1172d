"""The README's offline example, runnable: python examples/offline_inference.py"""

from tengyun import LLM, SamplingParams

llm = LLM()  # the embedded SmolLM2-135M-Instruct; or LLM(model="/path/to/Qwen2.5-0.5B-Instruct")
params = SamplingParams(temperature=0.0, max_tokens=32)

outputs = llm.generate(["The capital of France is", [1, 504, 3458]], params)  # text or token ids
for out in outputs:
    print(out.prompt, "->", out.outputs[0].text, out.outputs[0].finish_reason)

answer = llm.chat([{"role": "user", "content": "What is the capital of France?"}], params)
print(answer[0].outputs[0].text)  # "The capital of France is Paris."
