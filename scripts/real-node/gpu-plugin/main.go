// Command gpu-plugin is the real node's fake-GPU DRA kubelet plugin: test
// infrastructure for model-residency, not the product.
//
// It plays the NVIDIA DRA driver's kubelet plugin on a machine with no GPU,
// through the real kubelet's plugin API (registration, NodePrepareResources,
// NodeUnprepareResources): it publishes the node's GPUs as one ResourceSlice
// exactly as the project's kubelet stand-in does (driver gpu.nvidia.com,
// pool named after the node, devices gpu-<i> with the attributes type,
// index, minor, uuid, productName and the capacity memory), and prepares a
// claim by writing a CDI spec that containerd applies to every container
// using it: NVIDIA_VISIBLE_DEVICES=<uuids> as NVIDIA's driver sets it, plus
// FAKE_GPU_DEVICES=<device names> and FAKE_GPU_CLAIM=<namespace/name>, and
// FAKE_GPU_DEVICE_<NAME>=<uuid> per device (these add up over a pod's
// several claims, as a real driver's device nodes do).
// With --gpus-file, the GPU count is read from that file every second and
// the slice published again when it changes (a GPU added or taken away,
// the highest index first), as a driver does when a device comes or goes.
// What it fakes is the device itself: no memory, no /dev node.
package main

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"math/bits"
	"os"
	"os/signal"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/dynamic-resource-allocation/resourceslice"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"
)

const (
	driver = "gpu.nvidia.com"
	// The CDI kind of prepared claims. CDI needs spec version 0.5.0 or later
	// for device names that start with a digit, as claim UIDs may.
	cdiKind = "k8s.gpu.nvidia.com/claim"
	// The per-device variables' prefix: FAKE_GPU_DEVICE_GPU_3=<uuid>.
	devicePrefix = "FAKE_GPU_DEVICE_"
	cdiVersion   = "0.5.0"
)

type plugin struct {
	cdiDir string
	mu     sync.Mutex
	uuids  map[string]string // device name -> uuid
}

func main() {
	kubeconfig := flag.String("kubeconfig", "", "the kubeconfig the plugin publishes its ResourceSlice with")
	node := flag.String("node-name", "", "the node's name (the pool's and the slice's)")
	gpus := flag.Int("gpus", 2, "how many GPUs the node has")
	gpusFile := flag.String("gpus-file", "", "a file holding the GPU count, read every second (the slice follows it)")
	memory := flag.String("gpu-memory", "80Gi", "each GPU's memory (the slice's capacity)")
	product := flag.String("product-name", "NVIDIA H100 80GB HBM3 (real-node gpu-plugin)", "the productName attribute")
	registry := flag.String("registry-dir", kubeletplugin.KubeletRegistryDir, "the kubelet's plugins_registry directory")
	plugins := flag.String("plugins-dir", kubeletplugin.KubeletPluginsDir, "the kubelet's plugins directory (the plugin's socket goes in <dir>/gpu.nvidia.com)")
	cdiDir := flag.String("cdi-dir", "/etc/cdi", "where containerd reads CDI specs (its cdi_spec_dirs)")
	klog.InitFlags(nil)
	flag.Usage = func() {
		fmt.Fprintf(flag.CommandLine.Output(), "gpu-plugin: the real node's fake-GPU DRA kubelet plugin (driver %s, per-device variables %s<NAME>)\n", driver, devicePrefix)
		flag.PrintDefaults()
	}
	flag.Parse()
	if err := run(*kubeconfig, *node, *gpus, *gpusFile, *memory, *product, *registry, *plugins, *cdiDir); err != nil {
		klog.ErrorS(err, "gpu-plugin")
		os.Exit(1)
	}
}

func run(kubeconfig, node string, gpus int, gpusFile, memory, product, registry, plugins, cdiDir string) error {
	if node == "" || gpus < 1 || gpus > 128 {
		return errors.New("--node-name and 1 to 128 --gpus are required")
	}
	mem, err := resource.ParseQuantity(memory)
	if err != nil {
		return fmt.Errorf("--gpu-memory: %w", err)
	}
	config, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return err
	}
	client, err := kubernetes.NewForConfig(config)
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	socketDir := filepath.Join(plugins, driver)
	for _, dir := range []string{registry, socketDir, cdiDir} {
		if err := os.MkdirAll(dir, 0o750); err != nil {
			return err
		}
	}
	p := &plugin{cdiDir: cdiDir, uuids: map[string]string{}}
	if gpusFile != "" {
		if n, ok := readCount(gpusFile); ok {
			gpus = n
		}
	}
	devices := p.devices(node, gpus, mem, product)
	helper, err := kubeletplugin.Start(ctx, p,
		kubeletplugin.KubeClient(client),
		kubeletplugin.NodeName(node),
		kubeletplugin.DriverName(driver),
		kubeletplugin.RegistrarDirectoryPath(registry),
		kubeletplugin.PluginDataDirectoryPath(socketDir),
		kubeletplugin.HealthService(false),
	)
	if err != nil {
		return err
	}
	defer helper.Stop()
	resources := resourceslice.DriverResources{Pools: map[string]resourceslice.Pool{
		node: {Slices: []resourceslice.Slice{{Devices: devices}}},
	}}
	if err := helper.PublishResources(ctx, resources); err != nil {
		return err
	}
	klog.InfoS("publishing", "driver", driver, "node", node, "gpus", gpus)
	if gpusFile == "" {
		<-ctx.Done()
		return nil
	}
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
		}
		n, ok := readCount(gpusFile)
		if !ok || n == gpus {
			continue
		}
		gpus = n
		resources.Pools[node] = resourceslice.Pool{Slices: []resourceslice.Slice{{Devices: p.devices(node, gpus, mem, product)}}}
		if err := helper.PublishResources(ctx, resources); err != nil {
			klog.ErrorS(err, "publishing again", "gpus", gpus)
			continue
		}
		klog.InfoS("publishing", "driver", driver, "node", node, "gpus", gpus)
	}
}

// readCount reads a GPU count (1 to 128) from path.
func readCount(path string) (int, bool) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, false
	}
	n, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || n < 1 || n > 128 {
		return 0, false
	}
	return n, true
}

// devices are the node's first n GPUs, as the slice lists them; the uuids
// of those are what claims can be prepared with.
func (p *plugin) devices(node string, n int, mem resource.Quantity, product string) []resourceapi.Device {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.uuids = map[string]string{}
	devices := make([]resourceapi.Device, 0, n)
	for i := 0; i < n; i++ {
		name := fmt.Sprintf("gpu-%d", i)
		p.uuids[name] = gpuUUID(node, uint32(i))
		devices = append(devices, resourceapi.Device{
			Name: name,
			Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
				"type":        {StringValue: ptr.To("gpu")},
				"index":       {IntValue: ptr.To(int64(i))},
				"minor":       {IntValue: ptr.To(int64(i))},
				"uuid":        {StringValue: ptr.To(p.uuids[name])},
				"productName": {StringValue: ptr.To(product)},
			},
			Capacity: map[resourceapi.QualifiedName]resourceapi.DeviceCapacity{"memory": {Value: mem}},
		})
	}
	return devices
}

// gpuUUID is the kubelet stand-in's fake_gpu_uuid (src/local/kubelet.rs),
// so that a GPU has the same uuid on either node: FNV-1a over the node's
// name and the index's four little-endian bytes.
func gpuUUID(node string, index uint32) string {
	h := uint64(0xcbf29ce484222325)
	var idx [4]byte
	binary.LittleEndian.PutUint32(idx[:], index)
	for _, b := range append([]byte(node), idx[:]...) {
		h = (h ^ uint64(b)) * 0x100000001b3
	}
	l := bits.RotateLeft64(h, 29) ^ 0x9e3779b97f4a7c15
	return fmt.Sprintf("GPU-%08x-%04x-%04x-%04x-%012x", h>>32, (h>>16)&0xffff, h&0xffff, l>>48, l&0xffffffffffff)
}

func (p *plugin) specPath(uid types.UID) string {
	return filepath.Join(p.cdiDir, fmt.Sprintf("%s-claim-%s.json", driver, uid))
}

// PrepareResourceClaims writes one CDI spec per claim, naming the devices
// allocated to it from this driver.
func (p *plugin) PrepareResourceClaims(ctx context.Context, claims []*resourceapi.ResourceClaim) (map[types.UID]kubeletplugin.PrepareResult, error) {
	out := make(map[types.UID]kubeletplugin.PrepareResult, len(claims))
	for _, claim := range claims {
		out[claim.UID] = p.prepare(claim)
	}
	return out, nil
}

func (p *plugin) prepare(claim *resourceapi.ResourceClaim) kubeletplugin.PrepareResult {
	if claim.Status.Allocation == nil {
		return kubeletplugin.PrepareResult{Err: fmt.Errorf("claim %s/%s is not allocated", claim.Namespace, claim.Name)}
	}
	var names, uuids []string
	byRequest := map[string][]string{}
	uuidOf := map[string]string{}
	for _, r := range claim.Status.Allocation.Devices.Results {
		if r.Driver != driver {
			continue
		}
		p.mu.Lock()
		uuid, ok := p.uuids[r.Device]
		p.mu.Unlock()
		if !ok {
			return kubeletplugin.PrepareResult{Err: fmt.Errorf("claim %s/%s: no device %q on this node", claim.Namespace, claim.Name, r.Device)}
		}
		byRequest[r.Device] = append(byRequest[r.Device], r.Request)
		uuidOf[r.Device] = uuid
		names = append(names, r.Device)
		uuids = append(uuids, uuid)
	}
	sort.Strings(names)
	sort.Strings(uuids)
	device := "claim-" + string(claim.UID)
	env := []string{
		"NVIDIA_VISIBLE_DEVICES=" + strings.Join(uuids, ","),
		"FAKE_GPU_DEVICES=" + strings.Join(names, ","),
		"FAKE_GPU_CLAIM=" + claim.Namespace + "/" + claim.Name,
	}
	// One variable per device as well: a pod with several claims gets
	// each claim's edits, and the shared names above keep only the last
	// claim's (containerd applies them in turn), where a real driver's
	// device nodes add up. These add up too, so a container sees every
	// device it was given.
	for _, name := range names {
		env = append(env, devicePrefix+strings.ToUpper(strings.ReplaceAll(name, "-", "_"))+"="+uuidOf[name])
	}
	spec := map[string]any{
		"cdiVersion": cdiVersion,
		"kind":       cdiKind,
		"devices": []any{map[string]any{
			"name":           device,
			"containerEdits": map[string]any{"env": env},
		}},
	}
	body, err := json.Marshal(spec)
	if err == nil {
		err = writeAtomically(p.specPath(claim.UID), body)
	}
	if err != nil {
		return kubeletplugin.PrepareResult{Err: err}
	}
	id := cdiKind + "=" + device
	var prepared []kubeletplugin.Device
	for _, name := range names {
		prepared = append(prepared, kubeletplugin.Device{
			Requests: byRequest[name], PoolName: poolOf(claim, name), DeviceName: name, CDIDeviceIDs: []string{id},
		})
	}
	return kubeletplugin.PrepareResult{Devices: prepared}
}

func poolOf(claim *resourceapi.ResourceClaim, device string) string {
	for _, r := range claim.Status.Allocation.Devices.Results {
		if r.Driver == driver && r.Device == device {
			return r.Pool
		}
	}
	return ""
}

func writeAtomically(path string, body []byte) error {
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, body, 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

// UnprepareResourceClaims removes each claim's CDI spec.
func (p *plugin) UnprepareResourceClaims(ctx context.Context, claims []kubeletplugin.NamespacedObject) (map[types.UID]error, error) {
	out := make(map[types.UID]error, len(claims))
	for _, claim := range claims {
		err := os.Remove(p.specPath(claim.UID))
		if errors.Is(err, os.ErrNotExist) {
			err = nil
		}
		out[claim.UID] = err
	}
	return out, nil
}

func (p *plugin) HandleError(ctx context.Context, err error, msg string) {
	klog.FromContext(ctx).Error(err, msg)
}

func (p *plugin) WatchHealthStatus(ctx context.Context, reports chan<- kubeletplugin.DeviceHealthReport) error {
	return kubeletplugin.ErrHealthNotSupported
}
