// comfy-mgpu web extension.
// 1. Device combos of MGPU nodes show each device's name and free/total memory (GET /mgpu/devices). Only the
//    text drawn and the menu entries change: widget VALUES stay "auto", "cpu", "cuda:N", "fsdp", so saved
//    workflows keep working when memory or GPU names change.
// 2. After MGPU Plan runs, its node shows per device a bar per phase (encode, sample, decode): what the device
//    holds then (text encoder, DiT or its shard, VAE, working memory) and the headroom, plus the plan table,
//    from the node's ui output (mgpu_chart, text).
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const COLORS = { text_encoder: "#4e79a7", dit: "#f28e2b", vae: "#59a14f", working: "#e15759" };
const LEGEND = [["text_encoder", "text encoder"], ["dit", "DiT"], ["vae", "VAE"], ["working", "working memory"]];
const ROW_PX = 66;
const TABLE_LINE_PX = 13;

let deviceLabels = {};
let labelsLoading = null;

function formatBytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let value = Math.abs(n);
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit += 1;
  }
  const text = unit === 0 ? String(value) : value.toFixed(1).replace(/\.0$/, "");
  return `${n < 0 ? "-" : ""}${text} ${units[unit]}`;
}

// Free memory changes as models load, so labels are re-read whenever the queue status changes.
function refreshLabels() {
  labelsLoading ??= api
    .fetchApi("/mgpu/devices")
    .then(async (res) => {
      if (res.ok) deviceLabels = (await res.json()).labels ?? {};
      app.graph?.setDirtyCanvas(true, true);
    })
    .catch((err) => console.warn("MGPU: cannot read /mgpu/devices", err))
    .finally(() => {
      labelsLoading = null;
    });
  return labelsLoading;
}

function relabelOpenMenu(values) {
  const menus = document.querySelectorAll(".litecontextmenu");
  const menu = menus[menus.length - 1];
  if (!menu) return;
  for (const entry of menu.querySelectorAll(".litemenu-entry")) {
    const value = entry.dataset.value;
    if (values.includes(value) && deviceLabels[value]) entry.textContent = deviceLabels[value];
  }
}

function labelDeviceCombo(widget) {
  Object.defineProperty(widget, "_displayValue", {
    configurable: true,
    get() {
      if (this.computedDisabled) return ""; // driven by a link, as ComfyUI's own combos show it
      return deviceLabels[this.value] ?? String(this.value ?? "");
    },
  });
  const onClick = widget.onClick;
  widget.onClick = function (options) {
    const out = onClick?.call(this, options);
    const values = this.options?.values;
    if (Array.isArray(values)) relabelOpenMenu(values);
    return out;
  };
}

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function addStyle() {
  if (document.getElementById("mgpu-style")) return;
  const style = el("style");
  style.id = "mgpu-style";
  style.textContent = `
.mgpu-plan { font: 11px sans-serif; color: var(--input-text, #ddd); overflow: auto; box-sizing: border-box; }
.mgpu-legend { display: flex; gap: 10px; margin-bottom: 4px; flex-wrap: wrap; }
.mgpu-legend span::before { content: ""; display: inline-block; width: 9px; height: 9px; margin-right: 3px;
  background: var(--mgpu-color); vertical-align: -1px; }
.mgpu-device { margin-bottom: 7px; }
.mgpu-phase { display: flex; align-items: center; gap: 4px; margin-top: 2px; }
.mgpu-phase-name { width: 44px; color: var(--descrip-text, #999); }
.mgpu-peak .mgpu-phase-name { font-weight: bold; color: var(--input-text, #ddd); }
.mgpu-phase-bytes { width: 56px; text-align: right; color: var(--descrip-text, #999); }
.mgpu-device-title { display: flex; justify-content: space-between; gap: 8px; white-space: nowrap; }
.mgpu-device-title b { overflow: hidden; text-overflow: ellipsis; }
.mgpu-bar { display: flex; flex: 1; height: 11px; background: #2a2a2a; border: 1px solid #555; border-radius: 3px;
  overflow: hidden; }
.mgpu-seg { height: 100%; min-width: 1px; }
.mgpu-seg[data-kind="working"] { background-image: repeating-linear-gradient(45deg, transparent 0 4px,
  rgba(255, 255, 255, 0.25) 4px 6px); }
.mgpu-headroom { height: 100%; background: repeating-linear-gradient(90deg, #3a3a3a 0 1px, transparent 1px 6px); }
.mgpu-table { margin: 6px 0 0; font: 10px monospace; white-space: pre-wrap; color: var(--descrip-text, #bbb); }`;
  document.head.append(style);
}

function renderBar(phase, budget, isPeak) {
  const line = el("div", "mgpu-phase");
  line.dataset.phase = phase.phase;
  if (isPeak) line.classList.add("mgpu-peak");
  const bar = el("div", "mgpu-bar");
  for (const seg of phase.segments) {
    const part = el("div", "mgpu-seg");
    part.dataset.kind = seg.kind;
    part.style.width = `${(100 * seg.bytes) / budget}%`;
    part.style.backgroundColor = COLORS[seg.kind] ?? "#999";
    part.title = `${seg.label}: ${formatBytes(seg.bytes)}`;
    bar.append(part);
  }
  const headroom = el("div", "mgpu-headroom");
  headroom.style.width = `${(100 * Math.max(budget - phase.bytes, 0)) / budget}%`;
  headroom.title = `free while ${phase.phase === "sample" ? "sampling" : phase.phase + "ing"}: ` +
    formatBytes(budget - phase.bytes);
  bar.append(headroom);
  line.append(el("span", "mgpu-phase-name", phase.phase), bar, el("span", "mgpu-phase-bytes", formatBytes(phase.bytes)));
  return line;
}

// One device: its name, peak and headroom, then a bar per phase (encode, sample, decode) scaled to its budget.
function renderDevice(row) {
  const box = el("div", "mgpu-device");
  box.dataset.device = row.device;
  const title = el("div", "mgpu-device-title");
  title.append(el("b", "", `${row.device} ${row.name}`),
    el("span", "", `peak ${formatBytes(row.peak_bytes)} of ${formatBytes(row.budget_bytes)}, ` +
      `headroom ${formatBytes(row.headroom_bytes)}`));
  box.append(title);
  const budget = Math.max(row.budget_bytes, 1);
  const peak = row.phases.reduce((a, b) => (b.bytes > a.bytes ? b : a));
  for (const phase of row.phases) box.append(renderBar(phase, budget, phase === peak && peak.bytes > 0));
  return box;
}

function planView(node) {
  addStyle();
  const root = el("div", "mgpu-plan");
  const legend = el("div", "mgpu-legend");
  for (const [kind, text] of LEGEND) {
    const item = el("span", "", text);
    item.style.setProperty("--mgpu-color", COLORS[kind]);
    legend.append(item);
  }
  const chart = el("div", "mgpu-chart");
  const table = el("pre", "mgpu-table");
  root.append(legend, chart, table);
  root.hidden = true;
  let minHeight = 0;
  const widget = node.addDOMWidget("mgpu_plan_view", "mgpu_plan_view", root, {
    serialize: false,
    hideOnZoom: false,
    getMinHeight: () => minHeight,
  });
  widget.serialize = false; // not a value: keeps widgets_values of saved workflows unchanged
  return {
    render(rows, text) {
      chart.replaceChildren(...rows.map(renderDevice));
      table.textContent = text;
      root.hidden = false;
      minHeight = 24 + rows.length * ROW_PX + (text.split("\n").length + 1) * TABLE_LINE_PX;
      const [w, h] = node.computeSize();
      node.setSize([Math.max(node.size[0], w, 520), Math.max(node.size[1], h)]);
      node.setDirtyCanvas(true, true);
    },
  };
}

app.registerExtension({
  name: "comfy-mgpu.devices-and-plan",
  async setup() {
    await refreshLabels();
    api.addEventListener("status", refreshLabels);
  },
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (nodeData.category !== "MGPU") return;
    const onNodeCreated = nodeType.prototype.onNodeCreated;
    nodeType.prototype.onNodeCreated = function () {
      const out = onNodeCreated?.apply(this, arguments);
      for (const widget of this.widgets ?? []) {
        if (widget.name === "device" && widget.type === "combo") labelDeviceCombo(widget);
      }
      if (nodeData.name === "MgpuPlan") this.mgpuPlanView = planView(this);
      return out;
    };
    if (nodeData.name !== "MgpuPlan") return;
    const onExecuted = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (message) {
      onExecuted?.apply(this, arguments);
      const rows = message?.mgpu_chart?.[0];
      if (rows) this.mgpuPlanView?.render(rows, message.text?.[0] ?? "");
    };
  },
});
