// Shared pieces of the page: error boxes, the confirmation dialog, the live-region status.
import {h, clear, append} from "./dom.js";

/** An API error as the page shows it: its code first, then the message (plain text). */
export function errorBox(err, what) {
  const code = err && err.code ? err.code : "error";
  const status = err && err.status ? ` (HTTP ${err.status})` : "";
  const message = err && err.message ? err.message : String(err);
  const hint = code === "auth.forbidden"
    ? "This token's role may not see or do this."
    : code.endsWith(".not_found") ? "It does not exist, or this token may not see it." : null;
  return h("div.error", {role: "alert", dataset: {code}},
    what ? h("strong", what, ": ") : null,
    h("code.errcode", code), status, " — ", h("span.errmsg", message),
    hint ? h("div.hint", hint) : null,
    err && err.retryable ? h("div.hint", "The same request may succeed if you retry.") : null);
}

/** Await a promise, rendering an error box in ``slot`` instead of throwing. Returns [value, error]. */
export async function attempt(promise, slot, what) {
  try {
    return [await promise, null];
  } catch (err) {
    if (err && err.name === "AbortError") return [null, err];
    if (slot) append(clear(slot), [errorBox(err, what)]);
    return [null, err];
  }
}

let pending = null; // the open confirmation: {resolve, onClose}

/**
 * Ask before acting: resolves to the values of the dialog's inputs (an object)
 * when confirmed, or null when cancelled (or when the page is left: see closeDialog).
 */
export function confirmAction({title, text, okLabel = "OK", danger = false, fields = []}) {
  closeDialog(); // one question at a time: an older one is cancelled
  const dialog = document.getElementById("confirm");
  const extra = document.getElementById("confirm-extra");
  document.getElementById("confirm-title").textContent = title;
  document.getElementById("confirm-text").textContent = text;
  const ok = document.getElementById("confirm-ok");
  ok.textContent = okLabel;
  ok.className = danger ? "danger" : "";
  clear(extra);
  const inputs = {};
  for (const f of fields) {
    const input = f.type === "checkbox"
      ? h("input", {type: "checkbox", name: f.name, id: `confirm-${f.name}`, checked: Boolean(f.value)})
      : h("input", {type: "text", name: f.name, id: `confirm-${f.name}`, value: f.value || "",
                    placeholder: f.placeholder || "", autocomplete: "off"});
    inputs[f.name] = input;
    extra.append(f.type === "checkbox"
      ? h("label.check", input, " ", f.label)
      : h("label", f.label, input));
  }
  dialog.returnValue = "";
  return new Promise((resolve) => {
    const mine = {resolve, onClose: null};
    mine.onClose = () => {
      if (pending !== mine) return;
      pending = null;
      if (dialog.returnValue !== "ok") return resolve(null);
      const values = {};
      for (const [name, input] of Object.entries(inputs)) values[name] = input.type === "checkbox" ? input.checked : input.value;
      resolve(values);
    };
    pending = mine;
    dialog.addEventListener("close", mine.onClose, {once: true});
    dialog.showModal();
    (fields.length ? inputs[fields[0].name] : ok).focus();
  });
}

/** Cancel the open confirmation, if any: its question belonged to a page that is being left. */
export function closeDialog() {
  const dialog = document.getElementById("confirm");
  if (pending) {
    const {resolve, onClose} = pending;
    pending = null;
    dialog.removeEventListener("close", onClose);
    resolve(null);
  }
  if (dialog.open) dialog.close("cancel");
}

/** The ``actor`` the page records on what it does: ``admin-web:<token id>``, or ``admin-web`` in open mode. */
export function actorOf(who) {
  return who && who.token_id ? `admin-web:${who.token_id}` : "admin-web";
}

/** A small "busy" wrapper for buttons: disabled while ``fn`` runs. */
export async function busy(button, fn) {
  button.disabled = true;
  try { return await fn(); } finally { button.disabled = false; }
}
