// Command weightlift-gpu-plugin is a kubelet device plugin that advertises N fake GPUs (default
// resource nvidia.com/gpu) on a machine that has none, so worker pods' GPU requests schedule
// and are allocated by the kubelet's device manager as on a GPU node. It speaks the kubelet's
// device-plugin API (k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1): serve DevicePlugin on a
// socket in the kubelet's device-plugins dir, Register with kubelet.sock, and register again
// whenever the kubelet restarts (it removes every plugin socket when it does).
//
// -resource names one or more extended resources, comma-separated, each `name` (-count devices)
// or `name=count`: `nvidia.com/gpu,nvidia.com/mig-1g.10gb=2` advertises MIG slices beside whole
// GPUs, as NVIDIA's plugin does with its mixed MIG strategy. Each is a plugin of its own (the API
// registers one resource per socket): socket weightlift-<last part>.sock, devices
// fake-<last part>-<i> (nvidia.com/gpu: weightlift-gpu.sock, fake-gpu-0...).
//
// With -fault-gate-dir it also hands every container it allocates devices to the local stack's
// test gate (weightlift/worker/p2p/faultgate.py): that host dir mounted read-write at gateMount,
// named by WEIGHTLIFT_FAULT_GATE_DIR, with WEIGHTLIFT_LOCAL_NODE saying the gate is honoured here.
// This is how real device plugins hand containers their driver files and env; the operator's pods
// cannot set these names themselves (spec.template.env refuses WEIGHTLIFT_*).
//
// Built by hack/build-node.sh inside the k8s.io/kubernetes wrapper module (same grpc, same API).
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

// gateMount is where a container sees the -fault-gate-dir host dir.
const gateMount = "/run/weightlift/faultgate"

type plugin struct {
	pluginapi.UnimplementedDevicePluginServer
	devices []*pluginapi.Device
	gateDir string // host dir mounted at gateMount in each allocated container; "" for none
}

func (p *plugin) GetDevicePluginOptions(context.Context, *pluginapi.Empty) (*pluginapi.DevicePluginOptions, error) {
	return &pluginapi.DevicePluginOptions{}, nil
}

// ListAndWatch sends the (fixed, always healthy) device list once and holds the stream open.
func (p *plugin) ListAndWatch(_ *pluginapi.Empty, s grpc.ServerStreamingServer[pluginapi.ListAndWatchResponse]) error {
	if err := s.Send(&pluginapi.ListAndWatchResponse{Devices: p.devices}); err != nil {
		return err
	}
	<-s.Context().Done()
	return nil
}

func (p *plugin) GetPreferredAllocation(context.Context, *pluginapi.PreferredAllocationRequest) (*pluginapi.PreferredAllocationResponse, error) {
	return &pluginapi.PreferredAllocationResponse{}, nil
}

// Allocate answers as NVIDIA's plugin does with its envvar strategy: the container learns its
// devices from NVIDIA_VISIBLE_DEVICES (no device nodes: there are none). With a gate dir, the
// container also gets it mounted and named (see the package comment).
func (p *plugin) Allocate(_ context.Context, req *pluginapi.AllocateRequest) (*pluginapi.AllocateResponse, error) {
	out := &pluginapi.AllocateResponse{}
	for _, c := range req.ContainerRequests {
		ids := strings.Join(c.DevicesIds, ",")
		resp := &pluginapi.ContainerAllocateResponse{
			Envs: map[string]string{"NVIDIA_VISIBLE_DEVICES": ids, "WEIGHTLIFT_FAKE_GPUS": ids},
		}
		if p.gateDir != "" {
			resp.Envs["WEIGHTLIFT_FAULT_GATE_DIR"] = gateMount
			resp.Envs["WEIGHTLIFT_LOCAL_NODE"] = "kubelet"
			resp.Mounts = []*pluginapi.Mount{{ContainerPath: gateMount, HostPath: p.gateDir}}
		}
		out.ContainerResponses = append(out.ContainerResponses, resp)
	}
	return out, nil
}

// openGate makes dir for every container to write: the workers run as uid 1000 (the tests'
// harness as root), and a worker claims a hold by renaming the harness's file, which a sticky
// dir (0o1777) would refuse; hence 0o777, set after the umask.
func openGate(dir string) (string, error) {
	abs, err := filepath.Abs(dir)
	if err != nil {
		return "", err
	}
	if err := os.MkdirAll(abs, 0o777); err != nil {
		return "", err
	}
	return abs, os.Chmod(abs, 0o777)
}

func (p *plugin) PreStartContainer(context.Context, *pluginapi.PreStartContainerRequest) (*pluginapi.PreStartContainerResponse, error) {
	return &pluginapi.PreStartContainerResponse{}, nil
}

func dial(ctx context.Context, path string) (*grpc.ClientConn, error) {
	return grpc.NewClient("unix://"+path, grpc.WithTransportCredentials(insecure.NewCredentials()))
}

// resource is one extended resource this command advertises, served on its own socket.
type resource struct {
	name  string
	count int
	slug  string // the name's last part, [a-z0-9-] only: the socket's and the devices' names
}

var notSlug = regexp.MustCompile(`[^a-z0-9]+`)

// parseResources reads -resource: `name[=count],...`; a bare name gets defaultCount devices.
func parseResources(spec string, defaultCount int) ([]resource, error) {
	var out []resource
	seen := map[string]string{}
	for _, item := range strings.Split(spec, ",") {
		name, countText, hasCount := strings.Cut(strings.TrimSpace(item), "=")
		count := defaultCount
		if hasCount {
			n, err := strconv.Atoi(countText)
			if err != nil || n < 1 {
				return nil, fmt.Errorf("-resource %q: count %q is not a positive integer", item, countText)
			}
			count = n
		}
		domain, part, ok := strings.Cut(name, "/")
		if !ok || domain == "" || part == "" {
			return nil, fmt.Errorf("-resource %q: expected an extended resource name such as nvidia.com/gpu", item)
		}
		slug := strings.Trim(notSlug.ReplaceAllString(strings.ToLower(part), "-"), "-")
		if other, dup := seen[slug]; dup {
			return nil, fmt.Errorf("-resource: %s and %s would share socket weightlift-%s.sock", other, name, slug)
		}
		seen[slug] = name
		out = append(out, resource{name: name, count: count, slug: slug})
	}
	return out, nil
}

// serve starts the plugin's gRPC server on sock and registers it with the kubelet.
func serve(dir, sock, resource string, p *plugin) (*grpc.Server, error) {
	_ = os.Remove(sock)
	lis, err := net.Listen("unix", sock)
	if err != nil {
		return nil, err
	}
	srv := grpc.NewServer()
	pluginapi.RegisterDevicePluginServer(srv, p)
	go func() { _ = srv.Serve(lis) }()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := dial(ctx, filepath.Join(dir, "kubelet.sock"))
	if err != nil {
		srv.Stop()
		return nil, err
	}
	defer conn.Close()
	_, err = pluginapi.NewRegistrationClient(conn).Register(ctx, &pluginapi.RegisterRequest{
		Version:      pluginapi.Version,
		Endpoint:     filepath.Base(sock),
		ResourceName: resource,
		Options:      &pluginapi.DevicePluginOptions{},
	})
	if err != nil {
		srv.Stop()
		return nil, err
	}
	return srv, nil
}

func main() {
	dir := flag.String("dir", pluginapi.DevicePluginPath, "the kubelet's device-plugins dir")
	resource := flag.String("resource", "nvidia.com/gpu",
		"extended resources to advertise, comma-separated: name (-count devices) or name=count")
	count := flag.Int("count", 8, "devices to advertise of each resource given without =count")
	gateDir := flag.String("fault-gate-dir", "", "host dir mounted read-write at "+gateMount+
		" in each allocated container, named by WEIGHTLIFT_FAULT_GATE_DIR (the local stack's test gate); empty: none")
	flag.Parse()

	resources, err := parseResources(*resource, *count)
	if err != nil {
		log.Fatal(err)
	}
	gate := ""
	if *gateDir != "" {
		abs, err := openGate(*gateDir)
		if err != nil {
			log.Fatalf("fault gate dir %s: %v", *gateDir, err)
		}
		gate = abs
	}
	plugins := make([]*plugin, len(resources))
	for r, res := range resources {
		plugins[r] = &plugin{gateDir: gate}
		for i := 0; i < res.count; i++ {
			plugins[r].devices = append(plugins[r].devices, &pluginapi.Device{
				ID: fmt.Sprintf("fake-%s-%d", res.slug, i), Health: pluginapi.Healthy})
		}
	}
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)

	servers := make([]*grpc.Server, len(resources))
	tick := time.NewTicker(500 * time.Millisecond)
	defer tick.Stop()
	for {
		for r, res := range resources {
			sock := filepath.Join(*dir, "weightlift-"+res.slug+".sock")
			// (Re-)register when our socket is gone: the kubelet removed it on its (re)start.
			if _, err := os.Stat(sock); err == nil && servers[r] != nil {
				continue
			}
			if servers[r] != nil {
				servers[r].Stop()
				servers[r] = nil
			}
			if _, err := os.Stat(filepath.Join(*dir, "kubelet.sock")); err != nil {
				continue
			}
			s, err := serve(*dir, sock, res.name, plugins[r])
			if err != nil {
				log.Printf("register %s with the kubelet: %v (retrying)", res.name, err)
				continue
			}
			servers[r] = s
			log.Printf("registered %d x %s on %s", res.count, res.name, sock)
		}
		select {
		case <-stop:
			for r, res := range resources {
				if servers[r] != nil {
					servers[r].Stop()
				}
				_ = os.Remove(filepath.Join(*dir, "weightlift-"+res.slug+".sock"))
			}
			return
		case <-tick.C:
		}
	}
}
