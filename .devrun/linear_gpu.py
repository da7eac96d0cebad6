"""deepspeed.linear on a GPU (session 9 smoke): LoRA + quantized base weight in bf16 on cuda, forward/backward,
against the same layer's CPU copy in float32 math; the FP8 quantizer on cuda vs on the host."""
import copy
import torch
from deepspeed_c.linear import LoRAConfig, OptimizedLinear, QuantizationConfig
from deepspeed_c.ops.fp_quantizer import FP_Quantize

torch.manual_seed(0)
for quant in (None, QuantizationConfig(q_bits=8), QuantizationConfig(q_bits=6), QuantizationConfig(q_bits=4)):
    lin = OptimizedLinear(256, 128, lora_config=LoRAConfig(lora_r=8, lora_alpha=16.0), quantization_config=quant,
                          dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        lin.lora_weight_2.weight.normal_(0, 0.02)
    x = torch.randn(4, 16, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = lin(x)
    y.float().pow(2).sum().backward()
    cpu = copy.deepcopy(lin).to("cpu")
    xc = x.detach().cpu().float().requires_grad_(True)
    yc = cpu.float()(xc) if quant is None else None
    rel = float((y.float().cpu() - yc).norm() / yc.norm()) if yc is not None else float("nan")
    print(f"quant={getattr(quant, 'q_bits', None)}: out {tuple(y.shape)} {y.dtype} finite={bool(torch.isfinite(y).all())}"
          f" grads lora1 {lin.lora_weight_1.weight.grad is not None} x {x.grad is not None} rel-vs-cpu {rel:.2e}")
q = FP_Quantize(QuantizationConfig(group_size=128))
w = torch.randn(512, 256).bfloat16()
qc = q.quantize(w.clone(), q_bits=8, q_mantisa_bits=3)
qg = q.quantize(w.cuda(), q_bits=8, q_mantisa_bits=3)
print("fp8 quantize cuda == cpu:", torch.equal(qc, qg.cpu()))
