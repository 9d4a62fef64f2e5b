// The one screen: where to help, how much memory to offer, and what the helper is doing.
import SwiftUI

struct ContentView: View {
    @ObservedObject var helper: HelperModel

    var body: some View {
        NavigationStack {
            Form {
                Section("Host") {
                    TextField("ws://host:8080/helper (empty: listen)", text: $helper.hostURL)
                        .textInputAutocapitalization(.never)
                        .autocorrectionDisabled()
                    TextField("Pairing code (first time)", text: $helper.pairingCode)
                        .keyboardType(.numbersAndPunctuation)
                    TextField("Model", text: $helper.model)
                        .textInputAutocapitalization(.never)
                }
                Section("Memory offered: \(gib(helper.budget))") {
                    Slider(value: $helper.budget, in: 256e6...max(helper.available, 512e6))
                        .disabled(helper.running)
                }
                Section {
                    Button(helper.running ? "Stop" : "Start") {
                        helper.running ? helper.stop() : helper.start()
                    }
                    if let e = helper.startError {
                        Text(e).foregroundStyle(.red)
                    }
                }
                if let s = helper.status {
                    Section("Status") {
                        row("State", s.state)
                        if let a = s.address { row("Listening on", a) }
                        if let c = s.pairing_code { row("Pairing code", c) }
                        row("Host", s.host ?? "none connected")
                        row("KV pages held", "\(s.helper["kv_pages"] ?? 0)")
                        row("Memory held", gib(Double(s.helper["held_bytes"] ?? 0)))
                        row("Link out / in", "\(gib(Double(s.link_sent_bytes))) / \(gib(Double(s.link_received_bytes)))")
                        row("Thermal state", thermalText(helper.thermal))
                        if let e = s.error { Text(e).foregroundStyle(.red) }
                    }
                }
            }
            .navigationTitle("tether helper")
        }
    }

    private func row(_ name: String, _ value: String) -> some View {
        HStack {
            Text(name)
            Spacer()
            Text(value).foregroundStyle(.secondary).monospacedDigit()
        }
    }

    private func gib(_ bytes: Double) -> String {
        String(format: "%.2f GiB", bytes / 1_073_741_824)
    }

    private func thermalText(_ t: ProcessInfo.ThermalState) -> String {
        switch t {
        case .nominal: return "nominal"
        case .fair: return "fair"
        case .serious: return "serious"
        case .critical: return "critical"
        @unknown default: return "unknown"
        }
    }
}
